"""Contractions of local shards, their collectives explicit.

Inside `scope`, registered local tensors meet in `einsum` or `matmul`
(`contract`), placed by `ops.einsum_plan`: the output is a local shard or
a partial sum the caller all-reduces. What cannot be placed raises
`Unsupported`. See docs/internals/local-run.md.
"""

import contextlib
import contextvars

import torch
import torch.distributed as dist

from keras_dtensor.ops.einsum_plan import plan_for

__all__ = [
    "Unsupported",
    "all_reduce",
    "contract",
    "copy_in",
    "scope",
    "share",
]

# `(mesh, {key: (tensor, placements, global shape)}, summed mesh dims)`;
# keyed by memory, shape and strides (a hook may hand on an alias).
_SCOPE = contextvars.ContextVar("keras_dtensor_local_shards", default=None)


class Unsupported(Exception):  # noqa: N818 (a signal, not an error)
    """The call cannot run on local shards: run it as DTensors."""


@contextlib.contextmanager
def scope(mesh, tensors):
    """Contractions of `tensors` (`(local, placements, global shape)`) run
    on local shards; yields the mesh dims left with partial sums."""
    known = {_key(t): (t, tuple(p), tuple(s)) for t, p, s in tensors}
    summed = set()
    token = _SCOPE.set((mesh, known, summed))
    try:
        yield summed
    finally:
        _SCOPE.reset(token)


def _key(t):
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def active():
    return _SCOPE.get() is not None


def _summed(x, groups):
    """`x` summed over each group, in place (`x` is contiguous)."""
    for group in groups:
        dist.all_reduce(x, group=group)
    return x


class _GradAsIs(torch.autograd.Function):
    """`fn(x)`; backward passes the gradient as it is."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyIn(torch.autograd.Function):
    """Identity; backward sums the gradient over groups."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad.contiguous().clone(), ctx.groups), None


def _tracked(x):
    return torch.is_grad_enabled() and x.requires_grad


def all_reduce(x, groups):
    if _tracked(x):
        return _GradAsIs.apply(
            x, lambda t: _summed(t.contiguous().clone(), groups)
        )
    return _summed(x.contiguous(), groups)  # no graph: x is a new output


def copy_in(x, groups):
    return _CopyIn.apply(x, tuple(groups)) if _tracked(x) else x


def share(x, n):
    return _GradAsIs.apply(x, lambda t: t / n) if _tracked(x) else x / n


def contract(subscripts, operands, run):
    """`run(*operands)` on local shards, placed by `subscripts`."""
    mesh, known, pending = _SCOPE.get()
    specs = []
    for x in operands:
        entry = known.get(_key(x))
        if entry is None:
            raise Unsupported("an operand of unknown layout")
        specs.append(entry[1:])
    found = plan_for(subscripts, mesh, tuple(specs))
    if found is None:
        raise Unsupported("a contraction of another kind")
    targets, _, placements, shape = found
    if any(t != s[0] for t, s in zip(targets, specs, strict=True)):
        raise Unsupported("operands that need a redistribution")
    out = run(*operands)
    pending.update(m for m, p in enumerate(placements) if p.is_partial())
    known[_key(out)] = (out, tuple(placements), tuple(shape))
    return out
