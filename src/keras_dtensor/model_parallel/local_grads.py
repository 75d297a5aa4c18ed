"""DTensor weights read as local tensors, and their gradients laid out.

`local_many` reads many weights through one autograd node;
`reduce_partial_grads` all-reduces replicated weights' partial-sum
gradients in buckets, as DDP does.
"""

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import config
from keras_dtensor.backend import object_state
from keras_dtensor.backend.shards import from_local
from keras_dtensor.ops.flat_buffers import all_reduce_packed

__all__ = ["local_many", "reduce_partial_grads"]

_SPECS = "_keras_dtensor_grad_specs"


def _spec(value, placements):
    """`value`'s spec with `placements`, built once per weight."""
    specs = object_state.get_on(value, _SPECS)
    if specs is None:
        specs = object_state.set_on(value, _SPECS, {})
    spec = specs.get(placements)
    if spec is None:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        own = value._spec
        spec = (
            own
            if placements == tuple(own.placements)
            else DTensorSpec(own.mesh, placements, tensor_meta=own.tensor_meta)
        )
        specs[placements] = spec
    return spec


class _ToLocalMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, specs, *values):
        ctx.specs = specs
        ctx.layouts = []
        out = []
        for value in values:
            local = value._local_tensor
            ctx.layouts.append((local.shape, local.stride()))
            out.append(local.view_as(local))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        out = [None]
        for grad, spec, (shape, stride) in zip(
            grads, ctx.specs, ctx.layouts, strict=True
        ):
            if grad is not None:
                if grad.stride() != stride:  # e.g. an expanded sum's
                    grad = grad.new_empty_strided(shape, stride).copy_(grad)
                grad = DTensor(grad, spec, requires_grad=grad.requires_grad)
            out.append(grad)
        return tuple(out)


def local_many(values, grad_placements=None):
    """`v.to_local(grad_placements=p)` for each value and placements (None:
    the value's own), the leaves among `values` through one autograd node."""
    grad_placements = grad_placements or [None] * len(values)
    out = [None] * len(values)
    shared, specs = [], []
    for i, (value, placements) in enumerate(
        zip(values, grad_placements, strict=True)
    ):
        if not (
            value.is_leaf and value.requires_grad and torch.is_grad_enabled()
        ):
            out[i] = value.to_local(grad_placements=placements)
            continue
        placements = tuple(
            value.placements if placements is None else placements
        )
        shared.append(i)
        specs.append(_spec(value, placements))
    if shared:
        locals_ = _ToLocalMany.apply(specs, *(values[i] for i in shared))
        for i, local_tensor in zip(shared, locals_, strict=True):
            out[i] = local_tensor
    return out


def _like(local_tensor, value):
    """`local_tensor` as a DTensor laid out as `value`, reusing its spec."""
    own = value._local_tensor
    if local_tensor.shape != own.shape or local_tensor.stride() != own.stride():
        mesh, placements = value.device_mesh, value.placements
        return from_local(
            local_tensor, mesh, placements, value.shape, value.stride()
        )
    return DTensor(local_tensor, value._spec, requires_grad=False)


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
            out[i] = _like(local, values[i])
    return out
