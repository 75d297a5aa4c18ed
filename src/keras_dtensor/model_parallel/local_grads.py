"""A DTensor weight read as its local tensor, its gradient laid out once.

Local runs (`model_parallel.local_run`, `local_split`, the einsum rule)
read each weight as its local tensor for the call:
`value.to_local(grad_placements=...)`. In backward, torch's `to_local`
builds a new `DTensorSpec` for the gradient (its placements hashed, its
shard order and global stride computed) and wraps the gradient in a
DTensor of it, for every weight at every step: on small layers, more
host work than the weight's own backward.

`local(value, grad_placements)` is the same autograd edge with the
gradient's spec built once per weight and placements. The gradient is the
same tensor with the same layout; it reaches the weight through autograd
as before, so `.grad` accumulation, hooks and `torch.autograd.grad` over
the weights are unchanged. `local_many` reads a model's weights through
one such edge (one autograd node instead of one a weight: a Python
Function's own cost, paid once). `like(local, value)` wraps a local tensor
laid out as `value` the same way (a reduced gradient handed to the
optimizer).
"""

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import object_state

__all__ = ["like", "local", "local_many"]

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


def _as_grad(grad, spec, shape, stride):
    """A local gradient as the weight's DTensor gradient, laid out as the
    local tensor it reached (`shape`, `stride`)."""
    if grad.stride() != stride:  # e.g. an expanded sum's gradient
        grad = grad.new_empty_strided(shape, stride).copy_(grad)
    return DTensor(grad, spec, requires_grad=grad.requires_grad)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, spec):
        local = value._local_tensor
        ctx.spec, ctx.shape, ctx.stride = spec, local.shape, local.stride()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return _as_grad(grad, ctx.spec, ctx.shape, ctx.stride), None


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
        return (
            None,
            *(
                None if grad is None else _as_grad(grad, spec, *layout)
                for grad, spec, layout in zip(
                    grads, ctx.specs, ctx.layouts, strict=True
                )
            ),
        )


def _cached(value):
    return value.is_leaf and value.requires_grad and torch.is_grad_enabled()


def local_many(values, grad_placements=None):
    """`[local(v, p) for v, p in zip(values, grad_placements)]`, the
    weights read through one autograd node.

    Args:
        values: DTensors; the leaves among them (variables' values) share
            one node, anything else takes torch's `to_local`.
        grad_placements: one entry per value (`None`: the value's own), or
            `None` for all.

    Returns:
        The local tensors, in order, each differentiable back to its value.
    """
    if grad_placements is None:
        grad_placements = [None] * len(values)
    out = [None] * len(values)
    shared, specs = [], []
    for i, (value, placements) in enumerate(
        zip(values, grad_placements, strict=True)
    ):
        if not _cached(value):
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


def local(value, grad_placements=None):
    """`value.to_local(grad_placements=grad_placements)` of a weight.

    Args:
        value: a DTensor; a leaf (a variable's value) takes the cached
            path, anything else torch's `to_local`.
        grad_placements: the gradient's placements (default: the
            value's own).

    Returns:
        The local tensor, differentiable back to `value`.
    """
    if not _cached(value):
        return value.to_local(grad_placements=grad_placements)
    placements = tuple(
        value.placements if grad_placements is None else grad_placements
    )
    return _ToLocal.apply(value, _spec(value, placements))


def like(local_tensor, value):
    """`local_tensor` as a DTensor laid out as `value` (its local shape
    and stride), without building a new spec."""
    own = value._local_tensor
    if local_tensor.shape != own.shape or local_tensor.stride() != own.stride():
        return DTensor.from_local(
            local_tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return DTensor(local_tensor, value._spec, requires_grad=False)
