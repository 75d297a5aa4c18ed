"""Keras's `slice_update` on DTensors: a KV cache updated on local shards."""

from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard

from keras_dtensor import model_parallel

__all__ = ["wrap_slice_update"]


def _aligned(inputs, start_indices, updates):
    """`(inputs, updates)`, a replicated one cut as the other shards."""
    if not (
        isinstance(inputs, DTensor)
        and isinstance(updates, DTensor)
        and inputs.device_mesh == updates.device_mesh
        and inputs.ndim == updates.ndim
    ):
        return inputs, updates
    mesh = inputs.device_mesh
    cut = [list(inputs.placements), list(updates.placements)]
    pairs = zip(inputs.placements, updates.placements, strict=True)
    for i, pair in enumerate(pairs):
        for to, source in ((0, pair[1]), (1, pair[0])):
            dim = source.dim if type(source) is Shard else None
            if (
                dim is not None
                and pair[to].is_replicate()
                and start_indices[dim] == 0
                and inputs.shape[dim] == updates.shape[dim]
                and inputs.shape[dim] >= mesh.size(i)  # no rank left empty
                and Shard(dim) not in cut[to]
            ):
                cut[to][i] = Shard(dim)
    if cut[0] != list(inputs.placements):
        inputs = inputs.redistribute(mesh, cut[0])
    if cut[1] != list(updates.placements):
        updates = updates.redistribute(mesh, cut[1])
    return inputs, updates


def wrap_slice_update(original):
    """Wraps `slice_update`: on DTensors, run on aligned local shards."""

    def slice_update(inputs, start_indices, updates):
        record = model_parallel.recorder()  # a DTensor run being recorded
        given = inputs
        if isinstance(inputs, DTensor) or isinstance(updates, DTensor):
            start_indices = [int(i) for i in start_indices]
            inputs, updates = _aligned(inputs, start_indices, updates)
        elif record is None:
            # A local run checked against such a run: the same cut.
            cut = model_parallel.local_cache(inputs, updates)
            inputs = inputs if cut is None else cut
        out = original(inputs, start_indices, updates)
        if record is not None:
            record.note_slice_update(given, out)
        return out

    return slice_update
