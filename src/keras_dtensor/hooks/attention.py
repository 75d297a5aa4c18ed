"""`dot_product_attention` on DTensors: Keras's function on local shards."""

from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras_dtensor.backend import context
from keras_dtensor.backend.layout import even_shards
from keras_dtensor.backend.shards import from_local

__all__ = ["wrap_dot_product_attention"]

# A query's split axis (batch, seq, heads, dim) -> the same axis of a mask
# or bias (batch, heads, seq, seq), counted from its end.
_MASK_AXIS = {0: -4, 2: -3}


def wrap_dot_product_attention(original):
    """Wraps the torch backend's `dot_product_attention`."""

    def dot_product_attention(query, key, value, bias=None, mask=None, *a, **k):
        if context.current() is None:
            return original(query, key, value, bias, mask, *a, **k)
        tensors = (query, key, value, bias, mask)
        dtensors = [t for t in tensors if isinstance(t, DTensor)]
        if not dtensors:
            return original(query, key, value, bias, mask, *a, **k)
        if not _split_alike(query, key, value):
            mesh = dtensors[0].device_mesh
            query, key, value = (
                _replicated(t, mesh) for t in (query, key, value)
            )
        bias, mask = (_following(query, t) for t in (bias, mask))
        local = (
            t.to_local() if isinstance(t, DTensor) else t
            for t in (query, key, value, bias, mask)
        )
        out = original(*local, *a, **k)
        mesh, placements = query.device_mesh, query.placements
        shape = (*query.shape[:-1], value.shape[-1])
        if even_shards(shape, mesh, placements):  # (the output is a view)
            return DTensor.from_local(out, mesh, placements, run_check=False)
        return from_local(out.contiguous(), mesh, placements, shape)

    return dot_product_attention


def _split_alike(query, key, value):
    """Whether q/k/v share mesh and placements over batch or heads."""
    for t in (query, key, value):
        if not isinstance(t, DTensor) or t.device_mesh != query.device_mesh:
            return False
        if tuple(t.placements) != tuple(query.placements):
            return False
    return all(
        p.is_replicate() or p.is_shard(0) or p.is_shard(2)
        for p in query.placements
    )


def _replicated(tensor, mesh):
    placements = [Replicate()] * mesh.ndim
    if isinstance(tensor, DTensor):
        return tensor.redistribute(tensor.device_mesh, placements)
    return DTensor.from_local(tensor, mesh, placements, run_check=False)


def _following(query, mask):
    """`mask` (or bias) laid out as the query's split needs it."""
    if mask is None:
        return None
    placements = []
    for p in query.placements:
        axis = _MASK_AXIS.get(p.dim) if p.is_shard() else None
        if axis is None or mask.ndim < -axis or mask.shape[axis] == 1:
            placements.append(Replicate())  # (broadcast along the split)
        else:
            placements.append(Shard(mask.ndim + axis))
    mesh = query.device_mesh
    if isinstance(mask, DTensor):
        if tuple(mask.placements) == tuple(placements):
            return mask
        return mask.redistribute(mesh, placements)
    # A global value on every process: each takes its part.
    return distribute_tensor(mask, mesh, placements, src_data_rank=None)
