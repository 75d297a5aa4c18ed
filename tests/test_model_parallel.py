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

    out = {}
    for mesh_shape, axis_names, kind, model_name, optimizer in cases:
        mesh = keras.distribution.DeviceMesh(mesh_shape, axis_names)
        if kind == "tp":
            layouts = models.TP_LAYOUTS[model_name]
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
        out[key] = {
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
)

CASES_4 = (
    [
        ((2, 2), ("batch", "model"), "tp", m, o)
        for m in MODELS
        for o in ("sgd", "adam")
    ]
    + [((4,), ("batch",), "fsdp", m, "adamw") for m in MODELS]
    + [((1, 4), ("batch", "model"), "tp", "mlp", "rmsprop")]
)


def test_parity_2_processes():
    _check(run_ranks(_parity_cases, 2, CASES_2), 2, CASES_2)


def test_parity_4_processes():
    _check(run_ranks(_parity_cases, 4, CASES_4, timeout=400), 4, CASES_4)
