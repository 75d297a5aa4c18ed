"""Contractions of local shards, their collectives explicit.

A tensor-parallel layer (a `Dense` or `EinsumDense` split by columns or
rows) run as DTensors pays DTensor's per-op dispatch on every op of its
call, forward and backward: on a GPU step of small layers, or a token of
`generate`, that host work is the step. Run on local shards instead (what
torch's own tensor parallelism does for its layers' compute, and Megatron's
explicit collectives), only the contractions need to know the layout:
inside `scope(...)`, the local tensors registered with their placements and
global shapes (the layer's weights and inputs) meet in `einsum` or
`matmul`, whose layout `einsum.shard_plan`'s rules give: the output is a
local shard, or each rank's part of a partial sum, which the caller
reduces when the layer returns (`all_reduce`; backward: the gradient
passes as it is, as DTensor's own does for a sum). What follows the
contraction in the layer (a bias, an activation) is elementwise on
matching shards; a replicated bias meeting a partial sum is each rank's
share of it (`share`: DTensor adds `bias / N` on every rank).

A contraction this cannot place (an operand it does not know, layouts that
need a redistribution) raises `Unsupported`, and the caller runs the layer
as DTensors.
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

# `(mesh, {key: (tensor, placements, global shape)})` of the layer call
# running on local shards, or None. Keyed by the tensor's memory, shape
# and strides: a module hook may hand the layer an alias of its input
# (torch's backward hooks wrap a module's inputs), the same values. The
# registered tensors are alive for the scope, so no other tensor shares
# their key.
_SCOPE = contextvars.ContextVar("keras_dtensor_local_shards", default=None)


class Unsupported(Exception):  # noqa: N818 (a signal, not an error)
    """The call cannot run on local shards: run it as DTensors."""


@contextlib.contextmanager
def scope(mesh, tensors):
    """Contractions of `tensors` (`[(local, placements, global shape)]`)
    inside run on local shards. Yields the set of mesh dims over which a
    contraction left partial sums."""
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


class _AllReduce(torch.autograd.Function):
    """Sum over a group; backward passes the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, groups):
        out = x.contiguous().clone()
        for group in groups:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Share(torch.autograd.Function):
    """`x / n` on each of n ranks whose parts are summed: the gradient of
    `x` is the whole one (the sum of the n parts' is)."""

    @staticmethod
    def forward(ctx, x, n):
        return x / n

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyIn(torch.autograd.Function):
    """Identity; backward sums the gradient over a group (a replicated
    input of a split layer: each rank's gradient is its shard's part)."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, group=group)
        return grad, None


def _tracked(x):
    return torch.is_grad_enabled() and x.requires_grad


def all_reduce(x, groups):
    if _tracked(x):
        return _AllReduce.apply(x, tuple(groups))
    # No graph (a `generate` step): the sum in place, x being the layer's
    # own new output.
    x = x.contiguous()
    for group in groups:
        dist.all_reduce(x, group=group)
    return x


def copy_in(x, groups):
    return _CopyIn.apply(x, tuple(groups)) if _tracked(x) else x


def share(x, n):
    return _Share.apply(x, n) if _tracked(x) else x / n


def contract(subscripts, operands, run):
    """`run(*operands)` on local shards, laid out by `subscripts`.

    Returns None outside a `scope` (the caller goes on as usual); raises
    `Unsupported` for operands or layouts it cannot place.
    """
    current = _SCOPE.get()
    if current is None:
        return None
    mesh, known, pending = current
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
