"""Gradients that arrive as partial sums, reduced together.

Under a layout with the batch axis, the gradient of every weight that is
replicated over that axis (biases, norms, anything the `LayoutMap` leaves
out) comes back from backward as a partial sum (`Partial`) over it. Laid
out one by one, that is one all-reduce per variable (a 2-block transformer:
20 per step). DDP and FSDP2 reduce such gradients in buckets; here the
partial sums that resolve to a replicated placement are packed into flat
buffers of at most `KERAS_DTENSOR_BUCKET_MB` (grouped by mesh, reduced
mesh axes and dtype) and reduced with one all-reduce per buffer and axis.
A gradient at least the bucket's size is reduced alone, in place, with no
copy. The sums equal one all-reduce per gradient: each element goes
through the same collective, with others beside it.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras_dtensor import config
from keras_dtensor.model_parallel import local_grads

__all__ = ["reduce_partial_grads"]


def _key(grad, value):
    """The bucket a gradient joins, or None when it is not a partial sum
    that reduces to `value`'s placements."""
    if not isinstance(grad, DTensor) or not isinstance(value, DTensor):
        return None
    if grad.device_mesh != value.device_mesh:
        return None
    dims = []
    for dim, (have, want) in enumerate(
        zip(grad.placements, value.placements, strict=True)
    ):
        if have.is_partial():
            summed = getattr(have, "reduce_op", None) == "sum"
            if not summed or not want.is_replicate():
                return None
            dims.append(dim)
        elif have != want:
            return None
    if not dims:
        return None
    return (id(grad.device_mesh), tuple(dims), grad.dtype, grad.device)


def _reduce(locals_, mesh, dims):
    for dim in dims:
        group = mesh.get_group(dim)
        for tensor in locals_:
            dist.all_reduce(tensor, group=group)


def reduce_partial_grads(grads, values):
    """`grads` with every partial sum over replicated axes reduced.

    Args:
        grads: gradients, DTensors or None, in the optimizer's order (the
            same on every rank).
        values: the variables' values, in the same order.

    Returns:
        A list like `grads`; the reduced entries laid out as their value.
    """
    buckets = {}
    for index, (grad, value) in enumerate(zip(grads, values, strict=True)):
        key = _key(grad, value)
        if key is not None:
            buckets.setdefault(key, []).append(index)
    if not buckets:
        return grads
    out = list(grads)
    limit = config.get("BUCKET_MB") * 2**20
    for (_, dims, _, _), indices in buckets.items():
        mesh = grads[indices[0]].device_mesh
        pending = []
        for index in indices:
            local = grads[index].to_local()
            if local.numel() * local.element_size() >= limit:
                _reduce([local], mesh, dims)  # alone, in place
                out[index] = local_grads.like(local, values[index])
            else:
                pending.append(index)
        for chunk in _chunks(pending, grads, limit):
            locals_ = [grads[i].to_local() for i in chunk]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            _reduce([flat], mesh, dims)
            pieces = flat.split([t.numel() for t in locals_])
            for i, local, piece in zip(chunk, locals_, pieces, strict=True):
                out[i] = local_grads.like(piece.view(local.shape), values[i])
    return out


def _chunks(indices, grads, limit):
    chunk, size = [], 0
    for index in indices:
        local = grads[index].to_local()
        nbytes = local.numel() * local.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(index)
        size += nbytes
    if chunk:
        yield chunk
