"""ModelParallel parity: the same numbers as plain single-process Keras.

Every rank trains each model twice from the same seed: once as plain Keras
with no distribution (the single-process reference, in the same process),
once under `ModelParallel`. Weights, history, evaluate and predict must
agree to 1e-5, and each rank must hold only its shard.
"""

import math

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5


def _parity_cases(cases):
    import keras
    import models

    import keras_dtensor

    out = {}
    for mesh_shape, axis_names, kind, model_name, optimizer in cases:
        mesh = keras.distribution.DeviceMesh(mesh_shape, axis_names)
        if kind == "tp":
            layouts = models.TP_LAYOUTS[model_name]
        elif kind == "fsdp_tp":
            layouts = models.fsdp_tp_layouts(model_name)
        else:
            layouts = models.fsdp_layouts(model_name, axis_names[0])
        distribution = keras.distribution.ModelParallel(
            layout_map=models.layout_map(keras, mesh, layouts)
        )
        _, reference = models.train(keras, model_name, optimizer)
        model, result = models.train(keras, model_name, optimizer, distribution)
        weights = {
            v.path: (
                tuple(v.shape),
                tuple(v.value.to_local().shape),
                distribution.get_variable_layout(v).axes,
            )
            for v in model.weights
        }
        slots = {
            v.path: tuple(v.value.to_local().shape)
            for v in model.optimizer.variables
            if v.path.endswith(("momentum", "velocity"))
        }
        key = (mesh_shape, axis_names, kind, model_name, optimizer)
        # keras_dtensor.plan, built on meta, predicts the largest shards.
        planned = keras_dtensor.plan(
            lambda name=model_name: models.MODELS[name](keras),
            distribution,
            optimizer=models.OPTIMIZERS[optimizer](keras),
        )
        out[key] = {
            "planned": {v.path: v.local_shape for v in planned.variables},
            "planned_slot_bytes": planned.slot_bytes_per_rank,
            "diff": models.max_diff(reference, result),
            "weights": weights,
            "slots": slots,
            "history": result["history"],
        }
    return out


def _local_shape(shape, axes, mesh_shape, axis_names, rank):
    """torch.chunk-style shard shape at `rank` (devices in mesh order)."""
    coordinate = np.unravel_index(rank, mesh_shape)
    local = list(shape)
    for dim, entry in enumerate(axes):
        names = (
            ()
            if entry is None
            else (entry,)
            if isinstance(entry, str)
            else entry
        )
        for name in names:
            parts = mesh_shape[axis_names.index(name)]
            chunk = math.ceil(local[dim] / parts)
            index = coordinate[axis_names.index(name)]
            local[dim] = max(0, min(chunk, local[dim] - index * chunk))
    return tuple(local)


def _check(results, world, cases):
    for rank, out in enumerate(results):
        for key in cases:
            mesh_shape, axis_names = key[0], key[1]
            got = out[key]
            assert got["diff"] <= TOLERANCE, (key, rank, got["diff"])
            sharded = 0
            for path, (shape, local, axes) in got["weights"].items():
                expected = _local_shape(
                    shape, axes, mesh_shape, axis_names, rank
                )
                assert local == expected, (key, path, local, expected)
                sharded += local != shape
            assert sharded > 0, key  # the layout map applied
            if rank == 0:  # the first shards are the largest (torch.chunk)
                for path, (_, local, _) in got["weights"].items():
                    assert got["planned"][path] == local, (key, path)
            # Optimizer slots are laid out like their variable.
            locals_by_name = {
                p.replace("/", "_"): local
                for p, (_, local, _) in got["weights"].items()
            }
            for slot, local in got["slots"].items():
                owner = next(n for n in locals_by_name if n in slot)
                assert local == locals_by_name[owner], (key, slot)
            # Logged values are global: identical on every rank.
            assert got["history"] == results[0][key]["history"]


MODELS = ("mlp", "transformer", "embedding")

CASES_2 = (
    [
        ((1, 2), ("batch", "model"), "tp", m, o)
        for m in MODELS
        for o in ("sgd", "adam", "adamw", "rmsprop")
    ]
    + [((2,), ("model",), "tp", m, "adam") for m in MODELS]
    + [((2,), ("batch",), "fsdp", m, "adam") for m in MODELS]
    # Dims smaller than the axis: gradients must reach the optimizer in
    # their variable's layout (Dense(1) under the README's layout map).
    + [((1, 2), ("batch", "model"), "tp", "narrow", o) for o in ("sgd", "adam")]
)

CASES_4 = (
    [
        ((2, 2), ("batch", "model"), "tp", m, o)
        for m in MODELS
        for o in ("sgd", "adam")
    ]
    + [((4,), ("batch",), "fsdp", m, "adamw") for m in MODELS]
    # Weights sharded over both axes: gathered over "batch" only.
    + [((2, 2), ("batch", "model"), "fsdp_tp", m, "adam") for m in MODELS[:2]]
    + [((1, 4), ("batch", "model"), "tp", "mlp", "rmsprop")]
    + [((1, 4), ("batch", "model"), "tp", "narrow", "adamw")]
)


def test_parity_2_processes():
    _check(run_ranks(_parity_cases, 2, CASES_2), 2, CASES_2)


def test_parity_4_processes():
    _check(run_ranks(_parity_cases, 4, CASES_4, timeout=400), 4, CASES_4)


def _features(cache):
    """Training API details under ModelParallel, each against plain Keras.

    `cache`: an empty directory for torch's compile caches, shared by the
    ranks (as the default one is, by the processes of a machine)."""
    import keras
    import models
    import torch
    from torch.distributed.tensor import DTensor

    world = keras.distribution.get_device_count()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])

    def tp(extra=None):
        layouts = dict(models.TP_LAYOUTS["mlp"], **(extra or {}))
        return keras.distribution.ModelParallel(
            layout_map=models.layout_map(keras, mesh, layouts)
        )

    out = {}
    # Layer-output relayout ("<layer path>/output"), differentiable.
    _, reference = models.train(keras, "mlp", "sgd")
    _, got = models.train(
        keras, "mlp", "sgd", tp({".*up/output": ("batch", None)})
    )
    out["relayout"] = models.max_diff(reference, got)

    # jit_compile=True: a compiled forward on sharded weights; with
    # KERAS_DTENSOR_JIT=0 the model runs eagerly (nothing compiled).
    import os

    from keras_dtensor.backend import object_state

    _, reference = models.train(keras, "mlp", "adam", jit_compile=True)
    _, got = models.train(keras, "mlp", "adam", tp(), jit_compile=True)
    out["jit"] = models.max_diff(reference, got)
    os.environ["KERAS_DTENSOR_JIT"] = "0"
    try:
        model, got = models.train(keras, "mlp", "adam", tp(), jit_compile=True)
        out["jit_off"] = models.max_diff(reference, got)
        out["jit_off_compiled"] = object_state.get_on(model, "call") is not None
    finally:
        del os.environ["KERAS_DTENSOR_JIT"]
    out["jit_attention"] = _jit_attention(keras, models, mesh)
    out["jit_fallback"] = _jit_break(keras, tp(), lambda h: h[:, :4])
    out["jit_reshape"] = _jit_break(
        keras, tp(), lambda h: keras.ops.reshape(h, (-1, 2, 4))
    )
    out["jit_warm_cache"] = _jit_warm_cache(keras, tp(), cache)
    out["released_mib"] = _fit_releases_free_memory(keras, tp())

    # A dimension not divisible by its mesh axis: uneven (torch.chunk) shards.
    uneven = {
        ".*odd/kernel": (None, "model"),
        ".*odd/bias": ("model",),
        ".*out/kernel": ("model", None),
    }
    _, reference = models.train(keras, "odd", "adam")
    model, got = models.train(
        keras,
        "odd",
        "adam",
        keras.distribution.ModelParallel(
            layout_map=models.layout_map(keras, mesh, uneven)
        ),
    )
    out["uneven"] = models.max_diff(reference, got)
    out["uneven_local"] = (
        tuple(model.get_layer("odd").kernel.value.to_local().shape),
        tuple(model.get_layer("out").kernel.value.to_local().shape),
    )
    out["rank"] = torch.distributed.get_rank()
    out["fsdp_comms"] = _fsdp_collectives(keras, models, world)
    out["fsdp_local"] = _fsdp_local(keras, world)
    out["fsdp_groups"] = _fsdp_groups(keras, world)
    out["fsdp_mixed_dtypes"] = _fsdp_mixed_dtypes(keras, world)
    out["uneven_gather"] = _uneven_gather()
    out["tp_local"] = _tp_local(keras, world)
    out["whole_weights"] = _whole_weights_without_batch_axis(keras, mesh)

    # A key that matches no weight warns: functional-model paths have no
    # model prefix ("up/kernel", not "mlp/up/kernel").
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.train(
            keras, "mlp", "sgd", tp({"mlp/up/kernel": (None, "model")})
        )
    out["unmatched"] = [
        str(w.message) for w in caught if "matches none" in str(w.message)
    ]

    # sample_weight, validation_data and the usual callbacks.
    x, y = models.data("mlp")
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")

    def callbacks():
        return [
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1),
            keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.9),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1),
        ]

    fit_kwargs = dict(
        sample_weight=weights,
        validation_data=(x[:16], y[:16]),
        epochs=3,
    )
    histories = []
    for distribution in (None, tp()):
        _, result = _train_fit(
            keras, models, distribution, callbacks(), fit_kwargs
        )
        histories.append(result)
    out["callbacks"] = histories

    # Eager calls and the *_on_batch methods.
    results = []
    for distribution in (None, tp()):
        keras.utils.set_random_seed(5)
        scope = distribution.scope() if distribution else _null()
        with scope:
            model = models.mlp(keras)
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
            eager = model(x[:8])
            results.append(
                {
                    "eager": keras.ops.convert_to_numpy(eager),
                    "eager_dtensor": isinstance(eager, DTensor),
                    "train": model.train_on_batch(x[:8], y[:8]),
                    "test": model.test_on_batch(x[8:16], y[8:16]),
                    "predict": model.predict_on_batch(x[16:24]),
                    "torch_input": keras.ops.convert_to_numpy(
                        model(torch.from_numpy(x[:4]))
                    ),
                }
            )
    out["on_batch"] = results

    # Tensors a layer creates (seeded dropout and noise masks, ops.ones,
    # seed-generator increments) are global values: they meet the sharded
    # batch without "mixed torch.Tensor and DTensor".
    # keras.random with a SeedGenerator made under the scope, in user code.
    draws = []
    for distribution in (None, tp()):
        keras.utils.set_random_seed(8)
        with distribution.scope() if distribution else _null():
            generator = keras.random.SeedGenerator(7)
            draws.append(
                [
                    keras.ops.convert_to_numpy(
                        keras.random.normal((3,), seed=generator)
                    )
                    for _ in range(2)
                ]
            )
    out["seed_generator"] = draws
    # Sampling from a batch-sharded tensor (keras_hub's samplers): the
    # same draws as one process, not each rank's rows from the stream's
    # start.
    logits = np.random.default_rng(9).normal(size=(8, 16)).astype("float32")
    samples = [
        keras.ops.convert_to_numpy(
            keras.random.categorical(
                logits, 2, seed=keras.random.SeedGenerator(3)
            )
        )
    ]
    by_rows = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(
            keras.distribution.DeviceMesh((world, 1), ["batch", "model"])
        )
    )
    with by_rows.scope():
        sharded = keras.distribution.distribute_tensor(
            keras.ops.convert_to_tensor(logits),
            by_rows.get_data_layout(logits.shape),
        )
        samples.append(
            keras.ops.convert_to_numpy(
                keras.random.categorical(
                    sharded, 2, seed=keras.random.SeedGenerator(3)
                )
            )
        )
    out["categorical"] = samples
    sharded = {".*dense/kernel": (None, "model")}
    out["created"] = [
        _train_created(keras, distribution)
        for distribution in [None]
        + [
            keras.distribution.ModelParallel(
                layout_map=models.layout_map(
                    keras,
                    keras.distribution.DeviceMesh(shape, ["batch", "model"]),
                    sharded,
                )
            )
            for shape in ((world, 1), (1, world))
        ]
    ]
    return out


def _fsdp_collectives(keras, models, world):
    """Collectives of one train step under the FSDP-style layout."""
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = keras.distribution.DeviceMesh((world,), ["batch"])
    distribution = keras.distribution.ModelParallel(
        layout_map=models.layout_map(keras, mesh, models.fsdp_layouts("mlp"))
    )
    x, y = models.data("mlp")
    with distribution.scope():
        model = models.mlp(keras)
        model.compile(optimizer="adam", loss="mse")
        model.train_on_batch(x, y)
        with CommDebugMode() as comm:
            model.train_on_batch(x, y)
    counts = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1].strip("_")
        counts[name] = counts.get(name, 0) + n
    return counts


def _fsdp_local(keras, world):
    """What a layer's call sees under an FSDP-style layout (this rank's
    rows as plain tensors, or DTensors), and the numbers against plain
    Keras, for: a plain model, one with an activity regularizer (a loss
    added in the call: DTensors), one assigning a running mean of the
    batch in its call (DTensors), LoRA enabled after the first steps (new
    weights join the local path), a custom train_step taking
    `torch.autograd.grad` over the weights (one with an expanded
    gradient), tensor-parallel layouts over a model
    axis of one process (local), and with KERAS_DTENSOR_LOCAL_BATCH=0."""
    import os

    class Probe(keras.layers.Layer):
        def call(self, x):
            self.seen = (type(x).__name__, tuple(x.shape))
            return x

    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")

    class Running(keras.layers.Layer):
        """Assigns a running mean of the global batch in its call."""

        def build(self, shape):
            self.mean = self.add_weight(
                shape=(shape[-1],), initializer="zeros", trainable=False
            )

        def call(self, x):
            batch_mean = keras.ops.mean(x, axis=0)
            self.mean.assign(0.9 * self.mean + 0.1 * batch_mean)
            return x

    class Scale(keras.layers.Layer):
        """A weight whose gradient is expanded (a sum's: stride 0)."""

        def build(self, shape):
            self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            return x * keras.ops.sum(self.scale) / self.scale.shape[0]

    class GradModel(keras.Sequential):
        """A custom train_step taking `torch.autograd.grad` over the
        weights' values (their gradients reach them through autograd)."""

        def train_step(self, data):
            import torch

            x, y = data
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            weights = self.trainable_weights
            grads = torch.autograd.grad(loss, [v.value for v in weights])
            self.optimizer.apply(list(grads), weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    def run(
        distribution, regularizer=None, running=False, lora=False, grad=False
    ):
        keras.utils.set_random_seed(2)
        with distribution.scope() if distribution else _null():
            probe = Probe()
            model = (GradModel if grad else keras.Sequential)(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(
                        5, activity_regularizer=regularizer, name="up"
                    ),
                    *([Scale()] if grad else []),
                    probe,
                    *([Running()] if running else []),
                    keras.layers.Dense(4, name="out"),
                ]
            )
            model.compile(optimizer="sgd", loss="mse")
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
            if lora:  # weights created after the first steps
                model.get_layer("up").enable_lora(2)
                model.compile(optimizer="sgd", loss="mse")
                history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            return {
                "seen": probe.seen,
                "loss": history.history["loss"],
                "weights": model.get_weights(),
            }

    mesh = keras.distribution.DeviceMesh((world,), ["batch"])
    # Uneven shards (5 over 2 ranks), on either dimension.
    layouts = {".*up/kernel": (None, "batch"), ".*out/kernel": ("batch", None)}

    def fsdp():
        return keras.distribution.ModelParallel(
            layout_map=models_layout_map(keras, mesh, layouts)
        )

    from models import layout_map as models_layout_map

    out = {}
    for name, regularizer in (("plain", None), ("regularized", "l2")):
        out[name] = (run(None, regularizer), run(fsdp(), regularizer))
    out["running"] = (run(None, running=True), run(fsdp(), running=True))
    out["lora"] = (run(None, lora=True), run(fsdp(), lora=True))
    out["autograd_grad"] = (run(None, grad=True), run(fsdp(), grad=True))
    # Tensor-parallel layouts over a "model" axis of one process: local.
    mesh_2d = keras.distribution.DeviceMesh((world, 1), ["batch", "model"])
    tp_layouts = {
        ".*up/kernel": (None, "model"),
        ".*out/kernel": ("model", None),
    }
    tp_one = keras.distribution.ModelParallel(
        layout_map=models_layout_map(keras, mesh_2d, tp_layouts)
    )
    out["model_axis_of_one"] = (out["plain"][0], run(tp_one))
    os.environ["KERAS_DTENSOR_LOCAL_BATCH"] = "0"
    try:
        out["off"] = (out["plain"][0], run(fsdp()))
    finally:
        del os.environ["KERAS_DTENSOR_LOCAL_BATCH"]
    return out


# The models of `_tp_local` compared with plain Keras (and "stack").
TP_KINDS = (
    "plain",
    "norm",
    "heads",
    "center",
    "own_call",
    "residual",
    "row_activation",
)


def _tp_local(keras, world):
    """Tensor-parallel layouts with the ops between the sharded layers on
    local tensors (`boundary_layers`), against plain Keras: what a layer
    between a column- and a row-split Dense sees, which signatures run
    locally, a norm given head-sharded inputs (it runs as DTensors: its
    gamma's gradient is a sum over the heads' shards), a layer reshaping
    to a global size (it raises locally) and a layer taking a mean over
    the split columns (its outputs differ): each runs as DTensors, the
    rest locally; a column split's output added to a whole tensor by a
    functional model (a hidden-split embedding's case: the split layer
    hands its output on replicated); the mean in a model's own call (the
    whole model runs as DTensors, with a warning from rank 0), split Dense
    layers back to back (nothing between them: DTensors), and
    KERAS_DTENSOR_LOCAL_MODEL=0."""
    import os
    import warnings

    import models

    from keras_dtensor.model_parallel import local_run_check
    from keras_dtensor.model_parallel import local_split

    class Probe(keras.layers.Layer):
        def call(self, x):
            self.seen = (type(x).__name__, tuple(x.shape))
            return x

    class Center(keras.layers.Layer):
        def call(self, x):
            return x - keras.ops.mean(x, axis=-1, keepdims=True)

    class Centers(keras.Model):
        """Centers the split columns in its own call: nothing to hand to
        the DTensor run but the whole model."""

        def __init__(self, probe):
            super().__init__()
            self.up = keras.layers.Dense(16, name="up")
            self.probe = probe
            self.down = keras.layers.Dense(8, name="down")

        def call(self, x):
            f = self.probe(self.up(x))
            return self.down(f - keras.ops.mean(f, axis=-1, keepdims=True))

    class Heads(keras.layers.Layer):
        """Reshapes to the global head count and back (keras_hub's Gemma
        attention does): on a local shard, only with the local count."""

        def call(self, x):
            batch = keras.ops.shape(x)[0]
            h = keras.ops.reshape(x, (batch, 6, 4, 4))
            return keras.ops.reshape(h, (batch, 6, 16))

    class Widths(keras.layers.Layer):
        """Adds a tensor of the global width it was built with: on a local
        shard it raises."""

        def build(self, input_shape):
            self.width = input_shape[-1]

        def call(self, x):
            return x + keras.ops.zeros((self.width,))

    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 6, 8)).astype("float32")
    y = rng.normal(size=(16, 6, 8)).astype("float32")
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layouts = {
        ".*(query|key|value)/kernel": (None, "model", None),
        ".*(query|key|value)/bias": ("model", None),
        ".*attention_output/kernel": ("model", None, None),
        ".*up/kernel": (None, "model"),
        ".*up/bias": ("model",),
        ".*down/kernel": ("model", None),
        ".*q/kernel": (None, "model", None),
        ".*o/kernel": ("model", None, None),
    }

    def build(kind, probe):
        if kind == "own_call":
            return Centers(probe)
        if kind == "stack":  # nothing between the split layers
            probe.seen = None
            return keras.Sequential(
                [
                    keras.Input((6, 8)),
                    keras.layers.Dense(16, activation="relu", name="up"),
                    keras.layers.Dense(8, name="down"),
                ]
            )
        inputs = keras.Input((6, 8))
        if kind == "residual":
            h = probe(keras.layers.Dense(16, name="up")(inputs))
            a = keras.layers.MultiHeadAttention(4, 2, name="mha")(h, h)
            return keras.Model(
                inputs, keras.layers.Dense(8, name="down")(h + a)
            )
        if kind == "norm":  # per-head norm (Qwen3's, Gemma3's q/k norm)
            q = keras.layers.EinsumDense(
                "abc,cde->abde", (None, 4, 2), name="q"
            )(inputs)
            q = keras.layers.LayerNormalization(name="norm")(q)
            h = keras.layers.EinsumDense("abde,dec->abc", (None, 8), name="o")(
                probe(q)
            )
            return keras.Model(inputs, h)
        a = keras.layers.MultiHeadAttention(4, 2, name="mha")(inputs, inputs)
        h = keras.layers.LayerNormalization(name="ln")(inputs + a)
        f = probe(keras.layers.Dense(16, activation="relu", name="up")(h))
        if kind == "row_activation":  # DTensor reduces before the relu
            down = keras.layers.Dense(8, activation="relu", name="down")
            return keras.Model(inputs, h + down(f))
        if kind == "center":
            f = Center(name="center")(f)
        if kind == "heads":
            f = Widths(name="widths")(Heads(name="heads")(f))
        return keras.Model(inputs, h + keras.layers.Dense(8, name="down")(f))

    def run(distribution, kind="plain"):
        keras.utils.set_random_seed(5)
        with distribution.scope() if distribution else _null():
            probe = Probe()
            model = build(kind, probe)
            model.compile(optimizer=models.OPTIMIZERS["sgd"](keras), loss="mse")
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
            seen = probe.seen
            predicted = model.predict(x, batch_size=8, verbose=0)
            records = model.__dict__.get(local_run_check._RECORDS)
            return {
                "seen": seen,
                "loss": history.history["loss"],
                "weights": model.get_weights(),
                "predicted": np.asarray(predicted),
                "on_shards": sorted(
                    layer.name
                    for layer in model._flatten_layers()
                    if local_split.runs_on_shards(layer)
                ),
                "local": None
                if records is None
                else sorted(r is not None for r in records[1].values()),
                "boundary": None
                if not records or not any(records[1].values())
                else sorted(
                    layer.name
                    for layer in model._flatten_layers()
                    if id(layer)
                    in next(r for r in records[1].values() if r).boundary
                ),
                "replicated": None
                if records is None
                else sorted(
                    layer.name
                    for layer in model._flatten_layers()
                    if any(
                        id(layer) in state.replicated
                        for state in records[2].values()
                    )
                ),
            }

    def tp():
        return keras.distribution.ModelParallel(
            layout_map=models_layout_map(keras, mesh, layouts)
        )

    from models import layout_map as models_layout_map

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in (*TP_KINDS, "stack"):
            out[kind] = (run(None, kind), run(tp(), kind))
    out["warnings"] = [
        str(w.message) for w in caught if "runs as DTensors" in str(w.message)
    ]
    os.environ["KERAS_DTENSOR_LOCAL_MODEL"] = "0"
    try:
        out["off"] = (out["plain"][0], run(tp()))
    finally:
        del os.environ["KERAS_DTENSOR_LOCAL_MODEL"]
    return out


def _uneven_gather():
    """`packed_gather` on shards `torch.chunk` splits unevenly (padded in
    the packs, a rank with no rows at all), its buffers starting as NaN:
    the full tensors and the shards' gradients against whole-tensor
    arithmetic."""
    import torch
    import torch.distributed as dist

    from keras_dtensor.model_parallel import packed_gather

    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(3)
    specs = [(0, (5, 3)), (0, (1,)), (1, (2, 7))]
    full = [torch.randn(shape, generator=generator) for _, shape in specs]
    shards = [
        torch.chunk(t, world, dim)[rank].clone().requires_grad_()
        if rank < len(torch.chunk(t, world, dim))
        else t.narrow(dim, 0, 0).clone().requires_grad_()
        for t, (dim, _) in zip(full, specs, strict=True)
    ]
    # Every buffer packed_gather allocates starts as NaN: padding read back
    # would show.
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        return new_empty(self, *args, **kwargs).fill_(float("nan"))

    torch.Tensor.new_empty = poisoned
    try:
        pending = packed_gather.Pending(shards, specs, None)
        gathered = packed_gather.finish(pending, shards)
        forward = max(
            float((g - t).abs().max())
            for g, t in zip(gathered, full, strict=True)
        )
        # Rank r's gradient is (r + 1) x the full tensor: the shards get
        # the sum over ranks.
        torch.autograd.backward(gathered, [t * (rank + 1) for t in full])
    finally:
        torch.Tensor.new_empty = new_empty
    scale = world * (world + 1) / 2
    backward = max(
        float((s.grad - scale * torch.chunk(t, world, dim)[rank]).abs().max())
        if s.numel()
        else 0.0
        for s, t, (dim, _) in zip(shards, full, specs, strict=True)
    )
    return forward, backward, [tuple(s.shape) for s in shards]


def _fsdp_groups(keras, world):
    """FSDP2's per-block gather (`fsdp_blocks`), with groups of one layer
    (`KERAS_DTENSOR_GATHER_MB` tiny) and of the whole model (huge): the
    numbers against plain Keras, the collectives of a step, which earlier
    layers' gathered kernels are still alive when the fourth layer runs,
    and a model reading a freed kernel outside its layer (all weights
    gathered from then on, with a warning)."""
    import gc
    import os
    import warnings
    import weakref

    from torch.distributed.tensor.debug import CommDebugMode

    seen = []

    class Kept(keras.layers.Dense):
        """Notes a weak reference to the kernel its call reads."""

        def call(self, x):
            seen.append(weakref.ref(self.kernel.value))
            return super().call(x)

    class Alive(keras.layers.Layer):
        def call(self, x):
            gc.collect()
            # (A tuple: Keras tracks a list set on a layer.)
            self.alive = tuple(ref() is not None for ref in seen[-3:])
            return x

    class ReadsBack(keras.Model):
        """Reads its first layer's kernel after the second layer ran."""

        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(8, name="a")
            self.b = keras.layers.Dense(4, name="b")

        def call(self, x):
            h = self.b(self.a(x))
            return h + keras.ops.mean(self.a.kernel)

    rng = np.random.default_rng(6)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    mesh = keras.distribution.DeviceMesh((world,), ["batch"])

    def run(distribution, reads_back=False):
        keras.utils.set_random_seed(7)
        seen.clear()
        with distribution.scope() if distribution else _null():
            if reads_back:
                model = ReadsBack()
            else:
                probe = Alive()
                model = keras.Sequential(
                    [keras.Input((8,))]
                    + [Kept(8, activation="relu") for _ in range(3)]
                    + [probe, Kept(4)]
                )
            model.compile(optimizer="adam", loss="mse")
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
            out = {
                "loss": history.history["loss"],
                "weights": model.get_weights(),
            }
            if not reads_back:
                out["alive"] = list(probe.alive)
                with CommDebugMode() as comm:
                    model.train_on_batch(x[:8], y[:8])
                out["comms"] = {
                    str(op).split(".")[-1].strip("_"): n
                    for op, n in comm.get_comm_counts().items()
                }
        return out

    def fsdp():
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = ("batch", None)
        return keras.distribution.ModelParallel(layout_map=layout_map)

    out = {}
    for name, mib in (("layers", "0.0001"), ("whole", "1000")):
        os.environ["KERAS_DTENSOR_GATHER_MB"] = mib
        try:
            out[name] = (run(None), run(fsdp()))
            if name == "layers":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out["reads_back"] = (
                        run(None, reads_back=True),
                        run(fsdp(), reads_back=True),
                    )
                out["reads_back_warnings"] = [
                    str(w.message)
                    for w in caught
                    if "outside the layer" in str(w.message)
                ]
        finally:
            del os.environ["KERAS_DTENSOR_GATHER_MB"]
    return out


def _fsdp_mixed_dtypes(keras, world):
    """FSDP-style groups over layers of two dtypes (a float64 Dense between
    float32 ones; `KERAS_DTENSOR_GATHER_MB` small enough that a float32
    kernel alone does not fill a group): the dtype each layer's kernel has
    in its calls (the first one, the reference run, as DTensors), and the
    numbers, against plain Keras."""
    import os

    class Noted(keras.layers.Dense):
        def call(self, x):
            seen.setdefault(self.name, set()).add(str(self.kernel.value.dtype))
            return super().call(x)

    rng = np.random.default_rng(8)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    mesh = keras.distribution.DeviceMesh((world,), ["batch"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = ("batch", None)
    out = []
    os.environ["KERAS_DTENSOR_GATHER_MB"] = "0.0003"
    try:
        for distribution in (None, layout_map):
            if distribution is not None:
                distribution = keras.distribution.ModelParallel(
                    layout_map=layout_map
                )
            keras.utils.set_random_seed(7)
            seen = {}
            with distribution.scope() if distribution else _null():
                model = keras.Sequential(
                    [
                        keras.Input((8,)),
                        Noted(8, activation="relu", name="a"),
                        Noted(8, activation="relu", name="b", dtype="float64"),
                        Noted(8, activation="relu", name="c"),
                        Noted(4, name="d"),
                    ]
                )
                model.compile(optimizer="adam", loss="mse")
                history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
                out.append(
                    {
                        "loss": history.history["loss"],
                        "weights": model.get_weights(),
                        "dtypes": dict(seen),
                    }
                )
    finally:
        del os.environ["KERAS_DTENSOR_GATHER_MB"]
    return out


def _break_model(keras, distribution, piece):
    """Dense(8) -> `piece(relu(x))` after a graph break -> Flatten ->
    Dense(4), fit with `jit_compile=True` under `distribution`, eagerly
    without one: its losses and weights."""
    import torch

    class AcrossBreak(keras.layers.Layer):
        def call(self, x):
            h = keras.ops.relu(x)
            torch._dynamo.graph_break()
            return piece(h)

    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    keras.utils.set_random_seed(4)
    with distribution.scope() if distribution else _null():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(8, name="up")(inputs)
        h = keras.layers.Flatten()(AcrossBreak()(h))
        outputs = keras.layers.Dense(4, name="down")(h)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer="adam", loss="mse", jit_compile=bool(distribution)
        )
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        return [history.history["loss"], *model.get_weights()]


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(a, b, strict=True)
    )


def _jit_attention(keras, models, mesh):
    """jit_compile=True on the transformer (Keras's MultiHeadAttention,
    heads sharded): its compiled forward returns a transposed view across
    a graph break, which torch 2.13 rebuilt with as_strided (DTensor
    refuses it; the model fell back to eager). Now it runs compiled: no
    failure, the numbers of one eager process. (Its graph breaks make
    dynamo compile each layer's call separately: its first call reaches
    the recompile limit, and it runs eagerly from the next, jit.py.)"""
    import warnings

    from keras_dtensor.backend import object_state

    _, reference = models.train(keras, "transformer", "adam")
    distribution = keras.distribution.ModelParallel(
        layout_map=models.layout_map(
            keras, mesh, models.TP_LAYOUTS["transformer"]
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, got = models.train(
            keras, "transformer", "adam", distribution, jit_compile=True
        )
    forward = object_state.get_on(model, "call")
    return {
        "diff": models.max_diff(reference, got),
        "compiled": forward is not None and forward.error is None,
        "warnings": [
            str(w.message) for w in caught if "could not run" in str(w)
        ],
    }


def _jit_break(keras, distribution, piece):
    """jit_compile=True on `_break_model` with `piece`: the numbers against
    one eager process and the "runs eagerly" warnings. A piece that returns
    a view of its input makes AOTAutograd rebuild it (torch 2.13:
    as_strided, which DTensor refuses; keras-dtensor rebuilds a
    permutation or a reshape with permute / view, other views fall back to
    eager with the warning)."""
    import warnings

    import torch

    # Earlier cases compiled the same code objects (Functional.call): past
    # dynamo's recompile limit it would run them eagerly, without trying.
    torch._dynamo.reset()
    reference = _break_model(keras, None, piece)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _break_model(keras, distribution, piece)
    messages = [str(w.message) for w in caught if "eagerly" in str(w.message)]
    return _max_diff(reference, got), messages


def _jit_warm_cache(keras, distribution, cache):
    """A compiled forward loaded from torch's on-disk cache, which the
    ranks share: a cold compile, then (in-memory state reset) a warm one,
    each against one eager process. Without the rank in DTensor's cache
    key the warm run loaded another rank's program (loss off by 0.11)."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    def same(h):
        return h

    reference = _break_model(keras, None, same)
    diffs = []
    with (
        temporary_cache_dir(cache),
        torch._functorch.config.patch(enable_autograd_cache=True),
        torch._inductor.config.patch(fx_graph_cache=True),
    ):
        for _ in range(2):
            torch._dynamo.reset()
            torch.distributed.barrier()  # every rank's entries written
            diffs.append(
                _max_diff(reference, _break_model(keras, distribution, same))
            )
    return diffs


def _train_created(keras, distribution):
    class Offset(keras.layers.Layer):
        def call(self, x):
            ramp = keras.ops.arange(x.shape[-1], dtype="float32")
            return x + keras.ops.ones(keras.ops.shape(x)) * ramp

    keras.utils.set_random_seed(6)
    x = np.random.default_rng(0).normal(size=(32, 32)).astype("float32")
    with distribution.scope() if distribution else _null():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(16, name="dense"),
                keras.layers.Dropout(0.5, seed=1),
                Offset(),
                keras.layers.GaussianNoise(0.1, seed=2),
                keras.layers.Dense(
                    1,
                    name="head",
                    kernel_initializer=keras.initializers.RandomNormal(
                        seed=keras.random.SeedGenerator(3)
                    ),
                ),
            ]
        )
        model.compile(optimizer="adam", loss="mse")
        history = model.fit(
            x, x[:, :1], batch_size=8, epochs=2, shuffle=False, verbose=0
        )
        return history.history["loss"], model.get_weights()


def _whole_weights_without_batch_axis(keras, mesh):
    """A layer of whole weights called on its own (not inside a model)
    with a tensor-parallel block's output, on a mesh whose batch axis has
    one process: it runs on plain tensors (the whole batch on every rank);
    returns `(what its call saw, what its caller got)` and the largest
    difference from plain Keras."""
    import models

    class Norm(keras.layers.LayerNormalization):
        def call(self, x):
            self.seen = type(x).__name__
            return super().call(x)

    x = np.random.default_rng(6).normal(size=(4, 3, 8)).astype("float32")
    layouts = {".*up/kernel": (None, "model"), ".*down/kernel": ("model", None)}

    def run(distribution):
        keras.utils.set_random_seed(7)
        with distribution.scope() if distribution else _null():
            block = keras.Sequential(
                [
                    keras.Input((3, 8)),
                    keras.layers.Dense(16, name="up"),
                    keras.layers.Dense(8, name="down"),
                ]
            )
            norm = Norm(name="norm", gamma_initializer="random_normal")
            norm(block(x))  # builds the norm (as DTensors: no weights yet)
            out = norm(block(x))
            got = keras.ops.convert_to_numpy(out)
            return norm.seen, type(out).__name__, got

    _, _, reference = run(None)
    seen, got_type, got = run(
        keras.distribution.ModelParallel(
            layout_map=models.layout_map(keras, mesh, layouts)
        )
    )
    return (seen, got_type), float(np.max(np.abs(got - reference)))


def _null():
    import contextlib

    return contextlib.nullcontext()


def _train_fit(keras, models, distribution, callbacks, fit_kwargs):
    keras.utils.set_random_seed(4)
    x, y = models.data("mlp")
    scope = distribution.scope() if distribution else _null()
    with scope:
        model = models.mlp(keras)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        history = model.fit(
            x, y, batch_size=8, verbose=0, callbacks=callbacks, **fit_kwargs
        )
        weights = model.get_weights()
    return model, {"history": history.history, "weights": weights}


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """One 2-process run of `_features` (processes are the suite's cost),
    shared by the tests below, each of which checks one behaviour; its
    hang guard leaves room for a slow machine (about 150 s alone)."""
    tmp = tmp_path_factory.mktemp("features")
    return run_ranks(_features, 2, str(tmp), timeout=540)


def _assert_same_training(plain, dist):
    np.testing.assert_allclose(dist["loss"], plain["loss"], atol=TOLERANCE)
    for got, want in zip(dist["weights"], plain["weights"], strict=True):
        np.testing.assert_allclose(got, want, atol=TOLERANCE)


def test_relayout_and_uneven_shards_match_one_process(features):
    for out in features:
        assert out["relayout"] <= TOLERANCE
        assert out["uneven"] <= TOLERANCE
        # 5 units over 2 ranks: 3 and 2.
        width = (3, 2)[out["rank"]]
        assert out["uneven_local"] == ((16, width), (width, 4))


def test_jit_compile_matches_eager(features):
    for out in features:
        assert out["jit"] <= TOLERANCE
        assert out["jit_off"] <= TOLERANCE
        assert not out["jit_off_compiled"]
        assert max(out["jit_warm_cache"]) <= TOLERANCE, out["jit_warm_cache"]
        attention = out["jit_attention"]
        assert attention["diff"] <= TOLERANCE, attention
        assert attention["compiled"] and not attention["warnings"], attention
        diff, messages = out["jit_reshape"]
        assert diff <= TOLERANCE and messages == [], out["jit_reshape"]


def test_jit_falls_back_to_eager_with_one_warning(features):
    for out in features:
        diff, messages = out["jit_fallback"]
        assert diff <= TOLERANCE, diff
        if out["rank"] == 0:
            assert len(messages) == 1, messages
            assert "as_strided not supported with DTensor" in messages[0]
        else:
            assert messages == []  # warnings from rank 0 only


def test_release_free_memory_after_fit(features):
    for out in features:
        released = out["released_mib"]
        assert released is None or released > 32, released


def test_fsdp_step_makes_only_the_layer_collectives(features):
    for out in features:
        # 3 kernels gathered by one all-gather, their gradients scattered
        # by one reduce-scatter; the loss and one bucket of bias gradients
        # all-reduced, nothing else (no activation all-reduced).
        assert out["fsdp_comms"] == {
            "allgather_base": 1,
            "reduce_scatter_base": 1,
            "all_reduce": 1,
            "allreduce": 1,
        }, out["fsdp_comms"]


def test_whole_and_fsdp_weights_run_locally(features):
    for out in features:
        # Whole weights: the layers run on this rank's 4 rows as plain
        # tensors; a loss added in a call, or the setting off: DTensors.
        # A norm called on its own after tensor-parallel layers (keras_hub
        # `generate`'s final norm) on a (1, N) mesh: plain tensors, the
        # values of one process.
        seen, diff = out["whole_weights"]
        assert seen == ("Tensor", "DTensor") and diff <= 1e-6, (seen, diff)
        local = out["fsdp_local"]
        assert local["plain"][1]["seen"] == ("Tensor", (4, 5))
        assert local["lora"][1]["seen"] == ("Tensor", (4, 5))
        assert local["autograd_grad"][1]["seen"] == ("Tensor", (4, 5))
        assert local["model_axis_of_one"][1]["seen"] == ("Tensor", (4, 5))
        assert local["regularized"][1]["seen"][0] == "DTensor"
        assert local["running"][1]["seen"][0] == "DTensor"
        assert local["off"][1]["seen"][0] == "DTensor"
        for plain, dist in local.values():
            _assert_same_training(plain, dist)
        forward, backward, shapes = out["uneven_gather"]
        assert forward == 0.0 and backward <= 1e-6, out["uneven_gather"]
        assert (
            shapes
            == [[(3, 3), (1,), (2, 4)], [(2, 3), (0,), (2, 3)]][out["rank"]]
        ), shapes


def test_fsdp_groups_free_and_gather_kernels_by_group(features):
    for out in features:
        groups = out["fsdp_groups"]
        # One layer per group: each kernel freed after its layer's
        # forward (the third still in use), gathered again for backward
        # but for the first (no input gradient: its kernel is not needed)
        # and the last (kept); one reduce-scatter per group. One group:
        # everything alive, one gather, one reduce-scatter.
        assert groups["layers"][1]["alive"] == [False, False, True]
        assert groups["whole"][1]["alive"] == [True, True, True]
        assert groups["layers"][1]["comms"] == {
            "allgather_base": 4 + 2,
            "reduce_scatter_base": 4,
            "all_reduce": 1,
            "allreduce": 1,
        }, groups["layers"][1]["comms"]
        assert groups["whole"][1]["comms"]["allgather_base"] == 1
        if out["rank"] == 0:  # warnings from rank 0 only
            assert len(groups["reads_back_warnings"]) == 1, groups
            assert "'reads_back" in groups["reads_back_warnings"][0]
        else:
            assert groups["reads_back_warnings"] == []
        for kind in ("layers", "whole", "reads_back"):
            _assert_same_training(*groups[kind])


def test_fsdp_groups_keep_each_weights_dtype(features):
    # A group is one buffer of one dtype: a float64 kernel packed beside a
    # float32 one would reach its layer as float32.
    for out in features:
        plain, dist = out["fsdp_mixed_dtypes"]
        assert plain["dtypes"]["b"] == {"torch.float64"}, plain["dtypes"]
        assert dist["dtypes"] == plain["dtypes"], dist["dtypes"]
        _assert_same_training(plain, dist)


def test_tensor_parallel_layers_run_on_local_shards(features):
    for out in features:
        # The layer between the column- and the row-split Dense gets this
        # rank's half of the columns as a plain tensor; fit's and
        # predict's signatures both run locally; the per-head norm runs
        # as DTensors, and so does a layer whose outputs differ (the rest
        # stays local), and one that raises locally; a reshape to the
        # global head count runs locally; a mean over a split output makes
        # the split layer hand its output on whole.
        tp = out["tp_local"]
        assert tp["plain"][1]["seen"] == ("Tensor", (8, 6, 16 // 2))
        assert tp["plain"][1]["local"] == [True, True]
        split = ["attention_output", "down", "key", "query", "up", "value"]
        assert tp["plain"][1]["boundary"] == split
        # The split Dense/EinsumDense layers of a local run run on their
        # shards; a row split with an activation (DTensor reduces before
        # it) and a norm given head-sharded inputs run as DTensors.
        assert tp["plain"][1]["on_shards"] == split
        assert "down" not in tp["row_activation"][1]["on_shards"]
        assert "up" in tp["row_activation"][1]["on_shards"]
        assert tp["row_activation"][1]["local"] == [True, True]
        assert tp["norm"][1]["local"] == [True, True]
        assert tp["norm"][1]["boundary"] == ["norm", "o", "q"]
        assert tp["norm"][1]["on_shards"] == ["o", "q"]
        # A reshape to the global head count and back runs on the local
        # heads (`reshapes`); a layer whose outputs differ runs as DTensors.
        assert tp["heads"][1]["local"] == [True, True]
        assert "heads" not in tp["heads"][1]["boundary"], tp["heads"][1]
        assert "widths" in tp["heads"][1]["boundary"], tp["heads"][1]
        assert tp["center"][1]["local"] == [True, True]
        assert "center" in tp["center"][1]["boundary"], tp["center"][1]
        # Split Dense layers back to back: nothing to run locally.
        assert set(tp["stack"][1]["local"]) == {False}
        assert tp["residual"][1]["local"] == [True, True]
        assert tp["residual"][1]["replicated"] == ["up"]
        assert tp["residual"][1]["seen"] == ("Tensor", (8, 6, 16))
        assert tp["plain"][1]["replicated"] == []
        for kind in TP_KINDS:
            _assert_same_training(*tp[kind])


def test_tensor_parallel_model_own_call_runs_as_dtensors(features):
    for out in features:
        # A mean over the split columns in the model's own call makes the
        # whole model run as DTensors (warned on rank 0); the setting off
        # too. The mean of the whole columns rounds otherwise than the
        # DTensor run's sum of two halves: not bit for bit, so DTensors.
        tp = out["tp_local"]
        assert tp["own_call"][1]["seen"] == ("DTensor", (8, 6, 16))
        assert set(tp["own_call"][1]["local"]) == {False}
        assert tp["own_call"][1]["replicated"] == []
        assert tp["off"][1]["seen"] == ("DTensor", (8, 6, 16))
        _assert_same_training(*tp["off"])
        if out["rank"] == 0:
            assert len(tp["warnings"]) == 1, tp["warnings"]
            assert (
                "'down': an input of local shape (8, 6, 8)"
                in (tp["warnings"][0])
            )
        else:
            assert tp["warnings"] == []


def test_unmatched_layout_key_said_once_on_rank_0(features):
    for out in features:
        if out["rank"] == 0:
            assert len(out["unmatched"]) == 1
            assert "'mlp/up/kernel' matches none" in out["unmatched"][0]
        else:
            assert out["unmatched"] == []


def test_callbacks_and_validation_match_one_process(features):
    for out in features:
        plain, dist = out["callbacks"]
        assert plain["history"].keys() == dist["history"].keys()
        assert (
            "val_loss" in dist["history"] and "learning_rate" in dist["history"]
        )
        for key in plain["history"]:
            np.testing.assert_allclose(
                dist["history"][key], plain["history"][key], atol=TOLERANCE
            )
        for got, want in zip(dist["weights"], plain["weights"], strict=True):
            np.testing.assert_allclose(got, want, atol=TOLERANCE)


def test_on_batch_methods_match_one_process(features):
    for out in features:
        plain, dist = out["on_batch"]
        assert dist["eager_dtensor"] and not plain["eager_dtensor"]
        for key in ("eager", "train", "test", "predict", "torch_input"):
            np.testing.assert_allclose(dist[key], plain[key], atol=TOLERANCE)


def test_random_draws_match_one_process(features):
    for out in features:
        plain, dist = out["seed_generator"]
        np.testing.assert_array_equal(dist, plain)
        plain, dist = out["categorical"]
        np.testing.assert_array_equal(dist, plain)
        assert not np.array_equal(plain[0], plain[1])  # the state advanced


def test_tensors_created_in_a_call_train_as_on_one_process(features):
    for out in features:
        (plain_loss, plain_weights), *distributed = out["created"]
        for loss, weights in distributed:
            np.testing.assert_allclose(loss, plain_loss, atol=TOLERANCE)
            for got, want in zip(weights, plain_weights, strict=True):
                np.testing.assert_allclose(got, want, atol=TOLERANCE)


def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fragmented_garbage():
    """Frees about 85 MiB of 96 KiB blocks (under glibc's mmap threshold)
    while one block in three stays alive, so that the heap cannot shrink
    from its top: glibc keeps the freed memory resident. Returns the
    survivors."""
    import torch

    blocks = [torch.ones(24 * 1024) for _ in range(1366)]
    return blocks[::3]


def test_release_free_memory_gives_freed_blocks_back():
    """`malloc_trim.release_free_memory` (which `fit` calls under a
    distribution on several processes, see `_fit_releases_free_memory`)."""
    from keras_dtensor.hooks import malloc_trim

    if not malloc_trim.available():
        pytest.skip("not glibc")
    malloc_trim.release_free_memory()
    kept = _fragmented_garbage()
    before = _rss_mib()
    assert malloc_trim.release_free_memory()
    assert before - _rss_mib() > 32, (before, _rss_mib())
    del kept


def _fit_releases_free_memory(keras, distribution):
    """MiB of resident memory `fit` gave back before its first batch, with
    about 85 MiB freed but kept by glibc just before it."""
    import models

    from keras_dtensor.hooks import malloc_trim

    if not malloc_trim.available():
        return None
    x, y = models.data("mlp")
    seen = {}

    class Begin(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["rss"] = _rss_mib()

    with distribution.scope():
        model = models.mlp(keras)
        model.compile(optimizer="sgd", loss="mse")
        kept = _fragmented_garbage()
        before = _rss_mib()
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[Begin()])
    del kept
    return before - seen["rss"]
