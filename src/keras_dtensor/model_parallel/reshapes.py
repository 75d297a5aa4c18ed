"""Reshapes to global shapes in a local run, made local; and a replicated
KV cache cut to this rank's heads.

Each takes the local shape the same op had in the recorded DTensor run, in
call order; where the recorded shards differ in size, nothing changes.
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend.layout import local_slices
from keras_dtensor.backend.layout import placed_shape
from keras_dtensor.model_parallel import boundary_layers
from keras_dtensor.model_parallel import local_run
from keras_dtensor.model_parallel import local_shards
from keras_dtensor.model_parallel import reference_run

__all__ = ["local_cache", "wrap_reshape"]


def _local_reshape(x, newshape):
    """The local shape for `reshape(x, newshape)`, or None."""
    replay = _replay_for(x)
    if replay is None:
        return None
    i = replay.reshaped
    replay.reshaped += 1  # every reshape counts, as in the DTensor run
    shape = tuple(newshape) if isinstance(newshape, (list, tuple)) else None
    if shape is None or not all(type(n) is int for n in shape):
        return None
    recorded = replay.record.reshapes
    plan = recorded[i] if i < len(recorded) else None
    if plan is None:
        return None
    before, whole, local = plan
    if len(whole) != len(shape) or local == shape or x.shape != before:
        return None
    # As recorded: each dim asked for is the global one, the local one or -1.
    for asked, g, n in zip(shape, whole, local, strict=True):
        if asked not in (g, n, -1):
            return None
    return local


def wrap_reshape(original):
    """Wraps Keras's torch `reshape(x, newshape)`."""

    @functools.wraps(original)
    def reshape(x, newshape):
        # (Checked first: a traced call must not read the context.)
        if torch.compiler.is_compiling():
            return original(x, newshape)
        record = reference_run.recorder()
        if record is not None:
            out = original(x, newshape)
            record.note_reshape(x, out)
            return out
        shape = _local_reshape(x, newshape)
        return original(x, newshape if shape is None else shape)

    return reshape


def local_cache(inputs, updates):
    """A `slice_update`'s `inputs` cut to this rank's shard where the
    DTensor run cut a replicated cache; None for `inputs` as it is."""
    replay = _replay_for(inputs) if isinstance(updates, torch.Tensor) else None
    if replay is None:
        return None
    i = replay.sliced
    replay.sliced += 1
    recorded = replay.record.slice_updates
    if i >= len(recorded) or not all(
        reference_run.even(r, replay.mesh) for r in recorded[i]
    ):
        return None
    (before, whole), after = recorded[i]
    if inputs.shape != placed_shape(whole, replay.mesh, before):
        return None
    batch_dim = replay.record.run_spec.dim
    cut = list(before)
    for m, (was, now) in enumerate(zip(before, after[0], strict=True)):
        if m != batch_dim and was.is_replicate() and now.is_shard():
            cut[m] = now
    if cut == list(before):
        return None
    ranges = local_slices(whole, replay.mesh, cut)
    for d, (start, size) in enumerate(ranges):
        if size != inputs.shape[d]:
            inputs = inputs.narrow(d, start, size)
    return inputs


def _replay_for(x):
    """The replay of the checked local run `x` is a plain tensor of."""
    replay = boundary_layers.current_replay()
    if (
        not local_run.active()
        or local_shards.active()  # a split layer's own call
        or not isinstance(x, torch.Tensor)
        or isinstance(x, DTensor)
    ):
        return None
    return replay
