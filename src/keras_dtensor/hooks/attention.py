"""`dot_product_attention` on DTensor inputs: the global result.

Attention is independent per batch row and per head, so it runs on each
process's local shards when query, key and value are split alike over
batch or heads, and the mask (or bias) is split the same way along its own
batch and heads axes, or broadcast there (size 1). Keras 3.15 hands the
DTensors to torch's `scaled_dot_product_attention`, whose sharding rule
(`ops.strategies`) cannot move the mask, a keyword tensor; Keras 3.16
runs the local shards itself and rewraps the output with the query's
placements, which is silently wrong for any other layout (a pending
`Partial` sum, a split sequence).

So Keras's own function runs on local tensors, its output placed as the
query is, after:
- query, key and value not split alike over batch or heads are replicated
  (correct for any layout; the common cases, heads or batch split, keep
  their local run);
- the mask and bias are laid out to follow the query. A plain mask is a
  global value (the single-program rule of `backend.context`): each
  process takes its part of it, with no communication.
"""

import torch

from keras_dtensor.backend import context
from keras_dtensor.backend.layout import contiguous_strides

__all__ = ["wrap_dot_product_attention"]

# The query's split axes in Keras's (batch, seq, heads, dim) layout, and
# the same axes of a mask or bias broadcast to (batch, heads, seq, seq),
# counted from its last axis.
_MASK_AXIS = {0: -4, 2: -3}


def wrap_dot_product_attention(original):
    """Wraps the torch backend's `dot_product_attention`: see the module
    docstring."""

    def dot_product_attention(query, key, value, bias=None, mask=None, *a, **k):
        if context.current() is None:
            return original(query, key, value, bias, mask, *a, **k)
        from torch.distributed.tensor import DTensor

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
        # Keras's own function on the local shards (traceable by dynamo,
        # unlike 3.16's DTensor branch), the output placed as the query.
        local = (
            t.to_local() if isinstance(t, DTensor) else t
            for t in (query, key, value, bias, mask)
        )
        out = original(*local, *a, **k)
        mesh, placements = query.device_mesh, query.placements
        shape = (*query.shape[:-1], value.shape[-1])
        if _even(shape, mesh, placements):  # (the output is a view)
            return DTensor.from_local(out, mesh, placements, run_check=False)
        return DTensor.from_local(
            out.contiguous(),
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_strides(shape),
        )

    return dot_product_attention


def _even(shape, mesh, placements):
    """Whether every split of `shape` gives each process the same size."""
    return all(
        not p.is_shard() or shape[p.dim] % mesh.size(i) == 0
        for i, p in enumerate(placements)
    )


def _split_alike(query, key, value):
    """Whether q/k/v are DTensors on one mesh with the same placements,
    each `Shard(0)` (batch), `Shard(2)` (heads) or `Replicate()`."""
    from torch.distributed.tensor import DTensor

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
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate

    placements = [Replicate()] * mesh.ndim
    if isinstance(tensor, DTensor):
        return tensor.redistribute(tensor.device_mesh, placements)
    return DTensor.from_local(tensor, mesh, placements, run_check=False)


def _following(query, mask):
    """`mask` (or bias) laid out as the query's split needs it."""
    if mask is None:
        return None
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

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
