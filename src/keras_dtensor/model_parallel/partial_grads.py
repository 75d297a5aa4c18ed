"""Gradients that arrive as partial sums, reduced together in buckets.

Partial sums over axes their weight is replicated on are grouped by mesh,
axes and dtype, and all-reduced in buckets of `KERAS_DTENSOR_BUCKET_MB`
(`ops.flat_buffers`), as DDP does.
"""

from torch.distributed.tensor import DTensor

from keras_dtensor import config
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.ops.flat_buffers import all_reduce_packed

__all__ = ["reduce_partial_grads"]


def _key(grad, value):
    """The bucket group of a partial sum reducing to `value`'s layout."""
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


def reduce_partial_grads(grads, values):
    """`grads` (in the optimizer's order, the same on every rank) with each
    partial sum over axes its value is replicated on reduced."""
    groups = {}
    for index, (grad, value) in enumerate(zip(grads, values, strict=True)):
        key = _key(grad, value)
        if key is not None:
            groups.setdefault(key, []).append(index)
    if not groups:
        return grads
    out = list(grads)
    cap = config.get("BUCKET_MB") * 2**20
    for (_, dims, _, _), indices in groups.items():
        mesh = grads[indices[0]].device_mesh
        summed = all_reduce_packed(
            [grads[i].to_local() for i in indices],
            [mesh.get_group(dim) for dim in dims],
            cap,
        )
        for i, local in zip(indices, summed, strict=True):
            out[i] = local_grads.like(local, values[i])
    return out
