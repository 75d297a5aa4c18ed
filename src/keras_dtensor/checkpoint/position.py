"""Where a run is inside an epoch, so a checkpoint resumes at that batch.

The random states at the epoch's start (its shuffle) and now, and the
epoch's metric states, each rank's in the manifest (JSON, no pickle). On
another number of processes every rank takes rank 0's random state and
the metric states are combined (DataParallel ranks hold partial sums).
"""

import base64
import json
import random

import keras
import numpy as np
import torch

from keras_dtensor.backend import context
from keras_dtensor.backend import launch

__all__ = ["capture", "random_state", "restore_metrics", "restore_random"]


def random_state() -> dict:
    """This process's global random generators (JSON-serializable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    torch_state = torch.get_rng_state().numpy().tobytes()
    return {
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "python": [version, list(internal), gauss_next],
        "torch": base64.b64encode(torch_state).decode(),
    }


def _set_random_state(state):
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    raw = bytearray(base64.b64decode(state["torch"]))
    torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())


def _metric_states(model):
    return [
        np.asarray(keras.ops.convert_to_numpy(v)).tolist()
        for v in model.metrics_variables
    ]


def capture(model, batches: int, epoch_begin: dict) -> dict:
    """The position after `batches` batches of this epoch (collective)."""
    mine = {
        "begin": epoch_begin,
        "moment": random_state(),
        "metrics": _metric_states(model),
    }
    shares = launch.all_gather_bytes(json.dumps(mine).encode())
    world, _ = launch.world()
    return {
        "batches": batches,
        "processes": world,
        "partial_metrics": context.is_data_parallel(),
        "ranks": [json.loads(share) for share in shares],
    }


def _own(position):
    world, rank = launch.world()
    same = position["processes"] == world
    return position["ranks"][rank if same else 0], same


def restore_random(position, which: str) -> None:
    """Sets the global generators as at the epoch's start (`"begin"`) or
    at the checkpoint (`"moment"`)."""
    share, _ = _own(position)
    _set_random_state(share[which])


def restore_metrics(model, position) -> None:
    """Puts the epoch's metric states back (after Keras reset them)."""
    variables = model.metrics_variables
    share, same = _own(position)
    partial_now = context.is_data_parallel()
    if same and partial_now == position["partial_metrics"]:
        values = share["metrics"]
    else:
        per_rank = [r["metrics"] for r in position["ranks"]]
        if position["partial_metrics"]:  # the global state is their sum
            values = [
                np.sum([np.asarray(r[i]) for r in per_rank], axis=0)
                for i in range(len(variables))
            ]
        else:
            values = per_rank[0]
        if partial_now and launch.world()[1] != 0:
            values = [np.zeros_like(np.asarray(v)) for v in values]
    if len(values) != len(variables):
        return  # another model's metrics: the epoch's logs start afresh
    for variable, value in zip(variables, values, strict=True):
        variable.assign(np.asarray(value, dtype=variable.dtype))
