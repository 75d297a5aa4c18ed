"""Sharding strategies for ops DTensor lacks (the torch rows of `PATCHES`):
CPU flash attention, `multinomial` (replicated: the one-process sample),
`scatter_reduce` and missing comparisons."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = [
    "elementwise",
    "flash_cpu",
    "flash_cpu_backward",
    "flash_cpu_backward_ops",
    "flash_cpu_ops",
    "keep_kwargs_in_place",
    "missing_comparisons",
    "register_elementwise",
    "replicated_sample",
    "sample_ops",
    "scatter_reduce",
    "scatter_reduce_ops",
]

_aten = torch.ops.aten


def _per_row_or_head(num_outputs, num_tensors, num_scalars, attn_mask):
    """Strategies: all replicated, or all sharded on dim 0 or dim 1."""
    strategies = []
    for placement in (Replicate(), Shard(0), Shard(1)):
        # A mask broadcast along the sharded dim stays replicated.
        mask = None if attn_mask is None else Replicate()
        if mask and placement.is_shard() and attn_mask.shape[placement.dim] > 1:
            mask = placement
        outputs = [placement] * num_outputs
        inputs = [placement] * num_tensors + [None] * num_scalars + [mask]
        strategies.append((outputs, inputs))
    return strategies


def flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, **kwargs):
    # -> (output, logsumexp); inputs q, k, v; scalars dropout_p, is_causal.
    return _per_row_or_head(2, 3, 2, kwargs.get("attn_mask"))


def flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, **kw
):
    # -> (grad_q, grad_k, grad_v); inputs grad_out, q, k, v, out, lse.
    return _per_row_or_head(3, 6, 2, kw.get("attn_mask"))


def elementwise(self, other=None, **kwargs):
    # -> one output; inputs self and, for `.Tensor` overloads, other.
    tensors = 2 if hasattr(other, "shape") else 1
    placements = [Replicate()]
    if tensors == 1 or tuple(other.shape) == tuple(self.shape):
        placements += [Shard(dim) for dim in range(len(self.shape))]
    return [([p], [p] * tensors + [None] * (2 - tensors)) for p in placements]


def replicated_sample(self, num_samples, replacement=False, **kwargs):
    # -> one output; input self; scalars num_samples, replacement.
    return [([Replicate()], [Replicate(), None, None])]


def scatter_reduce(self, dim, index, src, reduce, **kwargs):
    # -> one output; inputs self, index, src; scalars dim, reduce.
    def placed(p):
        return ([p], [p, None, p, p, None])

    strategies = [placed(Replicate())]
    shapes = [tuple(t.shape) for t in (self, index, src)]
    if len({len(shape) for shape in shapes}) == 1:
        dim %= len(shapes[0])
        for d in range(len(shapes[0])):
            if d != dim and len({shape[d] for shape in shapes}) == 1:
                strategies.append(placed(Shard(d)))
    return strategies


def scatter_reduce_ops():
    """`scatter_reduce` and `scatter_reduce_`, where torch has no rule."""
    ops = (_aten.scatter_reduce.two, _aten.scatter_reduce_.two)
    return [op for op in ops if not _has_strategy(op)]


def sample_ops():
    """The sampling op whose per-shard draws differ from one process's."""
    return [_aten.multinomial.default]


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _has_strategy(op):
    """Whether torch's DTensor has a sharding rule of its own for `op`."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = (
        "op_strategy_funcs",
        "op_single_dim_strategy_funcs",
        "op_to_rules",
    )
    return any(op in getattr(propagator, table, {}) for table in tables)


def missing_comparisons():
    """The comparison overloads torch's DTensor has no strategy for."""
    ops = [
        getattr(getattr(_aten, name), overload)
        for name in _COMPARISONS
        for overload in ("Tensor", "Scalar")
    ]
    return [op for op in ops if not _has_strategy(op)]


def keep_kwargs_in_place(strategy, op_schema):
    """Keeps strategies leaving keyword tensors (which DTensor never moves)."""
    current = [
        tuple(s.strategies[0].output_spec.placements)
        for s in op_schema.kwargs_strategy
    ]
    if not current:
        return strategy

    def placed(spec):
        tail = spec.input_specs[-len(current) :]
        return [tuple(s.placements) for s in tail if s is not None]

    kept = [spec for spec in strategy.strategies if placed(spec) == current]
    if kept:
        strategy.strategies = kept
    return strategy


def flash_cpu_ops():
    """The CPU flash-attention forward op."""
    return [_aten._scaled_dot_product_flash_attention_for_cpu.default]


def flash_cpu_backward_ops():
    """The CPU flash-attention backward op."""
    return [_aten._scaled_dot_product_flash_attention_for_cpu_backward.default]


def register_elementwise(ops):
    """Gives each op in `ops` the elementwise strategy (for tests)."""
    for op in ops:
        register_sharding(op)(elementwise)
