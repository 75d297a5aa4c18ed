"""jit_compile=True under ModelParallel when dynamo keeps compiling.

The compiled forward compiles once per input signature; once a function of
it has been compiled `torch._dynamo.config.recompile_limit` times, it runs
eagerly on every rank from the next call on, with one warning (rank 0).
Two ways to get there, both model-agnostic, against one eager process
(SGD: a wrong step shows as lr times the error):

- "shapes": a plain MLP fed batches of new sizes (one compile each);
- "layers": a graph break inside a layer (inside Keras's `name_scope`),
  as keras_hub's attention has, makes dynamo compile every layer's call
  separately: the first call alone reaches the limit (keras_hub's Llama of
  2 layers: 113 compilations, about a minute; too slow for this file).

The limit is lowered to 3 in the ranks to keep compilations few.
"""

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

LIMIT = 3
TOLERANCE = 2e-5
# Batch sizes of the "shapes" case, one train_on_batch each: 8 and 6
# compile, their repeats must not, 4 compiles a third time (the limit);
# everything after runs eagerly, 2 included.
SIZES = [8, 8, 6, 6, 4, 4, 2, 2, 8, 6]
LAST_COMPILED = 4  # index in SIZES of the call that reached the limit


def _mlp(keras):
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="up")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs)


def _broken(keras):
    import torch

    class Break(keras.layers.Layer):
        def call(self, x):
            h = keras.ops.relu(x)
            torch._dynamo.graph_break()
            return h * 0.5

    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, name="up")(inputs)
    h = Break()(h)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    h = keras.layers.Dense(8, activation="tanh", name="extra")(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs)


LAYOUTS = {
    ".*up/kernel": (None, "model"),
    ".*up/bias": ("model",),
    ".*mid/kernel": ("model", None),
}


def _train(keras, build, distribution, batches):
    """Builds, compiles (jit with a distribution) and trains on `batches`
    one train_on_batch each; returns the model, its weights and the number
    of frames dynamo compiled during each call."""
    import contextlib

    from torch._dynamo.utils import counters

    keras.utils.set_random_seed(7)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    compiled = []
    with scope:
        model = build(keras)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="mse",
            jit_compile=distribution is not None,
        )
        for x, y in batches:
            before = counters["frames"]["total"]
            model.train_on_batch(x, y)
            compiled.append(counters["frames"]["total"] - before)
        weights = model.get_weights()
    return model, weights, compiled


def _case(keras, build, batches):
    import warnings

    from keras_dtensor.backend import object_state

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in LAYOUTS.items():
        layout_map[key] = axes
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    _, reference, _ = _train(keras, build, None, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, got, compiled = _train(keras, build, distribution, batches)
    forward = object_state.get_on(model, "call")
    return {
        "diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(reference, got, strict=True)
        ),
        "compiled": compiled,
        "recompiles": getattr(forward, "recompiles", None),
        "error": repr(getattr(forward, "error", None)),
        "warnings": [
            str(w.message)
            for w in caught
            if "jit_compile=True" in str(w.message)
        ],
    }


def _cases():
    import keras
    import torch

    torch._dynamo.config.recompile_limit = LIMIT
    rng = np.random.default_rng(0)

    def batch(n):
        x = rng.normal(size=(n, 8)).astype("float32")
        return x, rng.normal(size=(n, 4)).astype("float32")

    shapes = [batch(n) for n in SIZES]
    # A new size after the fallback: eager compiles nothing (the frames
    # below the limit would compile again).
    layers = [batch(n) for n in (8, 8, 6, 6)]
    out = {"rank": torch.distributed.get_rank()}
    out["shapes"] = _case(keras, _mlp, shapes)
    torch._dynamo.reset()
    out["layers"] = _case(keras, _broken, layers)
    return out


def _check_case(out, name, last_compiled):
    r = out[name]
    assert r["diff"] <= TOLERANCE, (name, r)
    assert r["error"] == "None", (name, r)
    # Every rank stopped compiling at the call that reached the limit
    # (a new shape after it compiles nothing), and rank 0 says so once.
    assert r["compiled"][last_compiled] > 0, (name, r)
    assert not any(r["compiled"][last_compiled + 1 :]), (name, r)
    if out["rank"] == 0:
        assert len(r["warnings"]) == 1, (name, r["warnings"])
        assert "recompile_limit" in r["warnings"][0], r["warnings"]
        assert "every process" in r["warnings"][0], r["warnings"]
    else:
        assert r["warnings"] == [], (name, r["warnings"])
    assert r["recompiles"] is not None and r["recompiles"] >= LIMIT, r


def test_recompiling_forward_falls_back_to_eager_on_every_rank():
    results = run_ranks(_cases, 2, timeout=300)
    for out in results:
        # Once per distinct shape: the repeats of 8 and 6 compiled nothing.
        shapes = out["shapes"]["compiled"]
        assert shapes[0] > 0 and shapes[2] > 0, shapes
        assert shapes[1] == 0 and shapes[3] == 0, shapes
        _check_case(out, "shapes", LAST_COMPILED)
        # The graph break: the first call reached the limit by itself.
        _check_case(out, "layers", 0)
    # The count the ranks agreed on.
    for name in ("shapes", "layers"):
        assert len({out[name]["recompiles"] for out in results}) == 1
