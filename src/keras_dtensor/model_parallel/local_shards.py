"""Contractions of local shards, their collectives explicit, placed by
subscripts (`ops.einsum_plan`) for Keras's torch `einsum` and `matmul`.

Inside `scope`, registered local tensors contract to a local shard or a
partial sum the caller all-reduces, else raise `Unsupported`; outside
it, an einsum of DTensors runs once on the local shards.
"""

import contextvars
import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend.layout import contiguous_strides
from keras_dtensor.backend.shards import from_local
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.ops import einsum_plan

__all__ = [
    "Unsupported",
    "all_reduce",
    "contract",
    "copy_in",
    "scope",
    "share",
    "wrap_einsum",
    "wrap_matmul",
]

# `(mesh, {key: (tensor, placements, global shape)}, summed mesh dims)`;
# keyed by memory, shape and strides (a hook may hand on an alias).
_SCOPE = contextvars.ContextVar("keras_dtensor_local_shards", default=None)


class Unsupported(Exception):  # noqa: N818 (a signal, not an error)
    """The call cannot run on local shards: run it as DTensors."""


def scope(mesh, tensors):
    """Contractions of `tensors` (`(local, placements, global shape)`) run
    on local shards; yields `(mesh, them, mesh dims left partial sums)`."""
    known = {_key(t): (t, tuple(p), tuple(s)) for t, p, s in tensors}
    return context.scoped(_SCOPE, (mesh, known, set()))


def _key(t):
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def active():
    return _SCOPE.get() is not None


def _summed(x, groups):
    """`x` summed over each group, in place (`x` is contiguous)."""
    for group in groups:
        dist.all_reduce(x, group=group)
    return x


class _ByHand(torch.autograd.Function):
    """`forward(x)`, its gradient `backward(grad)`."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward(grad), None, None


def _tracked(x):
    return torch.is_grad_enabled() and x.requires_grad


def all_reduce(x, groups):
    if _tracked(x):
        return _ByHand.apply(
            x, lambda t: _summed(t.contiguous().clone(), groups), lambda g: g
        )
    return _summed(x.contiguous(), groups)  # no graph: x is a new output


def copy_in(x, groups):
    if not _tracked(x):
        return x
    return _ByHand.apply(
        x,
        lambda t: t.view_as(t),
        lambda g: _summed(g.contiguous().clone(), groups),
    )


def share(x, n):
    return (
        _ByHand.apply(x, lambda t: t / n, lambda g: g) if _tracked(x) else x / n
    )


def contract(subscripts, operands, run):
    """`run(*operands)` on local shards, placed by `subscripts`."""
    mesh, known, pending = _SCOPE.get()
    specs = []
    for x in operands:
        entry = known.get(_key(x))
        if entry is None:
            raise Unsupported("an operand of unknown layout")
        specs.append(entry[1:])
    found = einsum_plan.plan_for(subscripts, mesh, tuple(specs))
    if found is None:
        raise Unsupported("a contraction of another kind")
    targets, _, placements, shape = found
    if any(t != s[0] for t, s in zip(targets, specs, strict=True)):
        raise Unsupported("operands that need a redistribution")
    out = run(*operands)
    pending.update(m for m, p in enumerate(placements) if p.is_partial())
    known[_key(out)] = (out, tuple(placements), tuple(shape))
    return out


def _global_stride(local, shape):
    """Global strides in the local result's dim order (a permuted view)."""
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), d))
    strides = contiguous_strides([shape[d] for d in order])
    out = [0] * local.ndim
    for d, step in zip(order, strides, strict=True):
        out[d] = step
    return tuple(out)


def _tensors(values):
    convert_to_tensor = compat.torch_core().convert_to_tensor
    return [convert_to_tensor(x) for x in values]


def wrap_einsum(original):
    """Wraps Keras's torch `einsum(subscripts, *operands)`."""

    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        # (Checked first: a traced call must not read the context.)
        if torch.compiler.is_compiling():
            return original(subscripts, *operands, **kwargs)
        if active():  # a split layer's call on its shards
            return contract(
                subscripts,
                _tensors(operands),
                lambda *local: original(subscripts, *local, **kwargs),
            )
        # Operands may be Keras variables (`EinsumDense`'s kernel).
        if not any(
            isinstance(getattr(x, "_value", x), DTensor) for x in operands
        ):
            return original(subscripts, *operands, **kwargs)
        operands = _tensors(operands)
        mesh = getattr(operands[0], "device_mesh", None)
        found = all(
            isinstance(x, DTensor) and x.device_mesh == mesh for x in operands
        ) and einsum_plan.plan_for(
            subscripts,
            mesh,
            tuple((tuple(x.placements), tuple(x.shape)) for x in operands),
        )
        if not found:
            return original(subscripts, *operands, **kwargs)
        targets, grads, placements, shape = found
        operands = [
            x if tuple(x.placements) == t else x.redistribute(mesh, t)
            for x, t in zip(operands, targets, strict=True)
        ]
        local = local_grads.local_many(operands, grads)
        out = original(subscripts, *local, **kwargs)
        if _global_stride(out, tuple(out.shape)) != out.stride():
            out = out.contiguous()  # not a permuted dense result
        stride = _global_stride(out, shape)
        return from_local(out, mesh, placements, shape, stride)

    return einsum


def wrap_matmul(original):
    """Wraps Keras's torch `matmul(x1, x2)` for `scope`."""

    @functools.wraps(original)
    def matmul(x1, x2):
        if torch.compiler.is_compiling() or not active():
            return original(x1, x2)
        x1, x2 = _tensors((x1, x2))
        subscripts = einsum_plan.matmul_subscripts(x1.ndim)
        if x2.ndim != 2 or subscripts is None:
            raise Unsupported("a matmul of another kind")
        return contract(subscripts, [x1, x2], original)

    return matmul
