"""DTensor fixes that distributed Keras programs need from torch 2.13.

Only the functions live here; the `PATCHES` table (`patches.py`) installs
them, shows them in `keras-dtensor info` and takes them off again.

1. Every rank must choose the same sharding strategy for an op, or the
   ranks run different collectives and the job dies ("Received data size
   doesn't match expected size ... collective mismatch") or hangs.
   DTensor's strategy search breaks cost ties by the iteration order of
   Python sets of placements, which follows their hashes. String hashes
   must agree across ranks (one PYTHONHASHSEED; `launch._check_hash_seed`
   checks it at start); `_MaskPartial.__hash__` also hashes `id(mask_buffer)`,
   a memory address that differs between processes. `mask_partial_hash`
   leaves the address out (a hash may be coarser than `__eq__`, which
   compares the buffer by identity). Without it, a vocabulary-sharded
   Embedding allgathered its table on one rank only.

2. Sharding strategies for ops DTensor lacks, registered through the
   public experimental `register_sharding`; they only affect ops whose
   inputs are DTensors.

CPU flash attention (`torch.nn.functional.scaled_dot_product_attention` on
CPU, which Keras's `MultiHeadAttention` calls) has no strategy in torch
2.13, so head-parallel attention crashes in backward. Attention is
independent per batch row and per head: with q/k/v/out all sharded on the
batch dimension (0) or the head dimension (1), the op runs on local
shards, exactly like the single-device op on a slice.

Comparison ops (`eq`, `ne`, `lt`, ... on tensors and scalars) have
strategies from torch 2.13 on; torch 2.11 lacks some (`aten.ne.Tensor`,
which Keras's optimizer EMA runs on its replicated `iterations`). Where torch
has none, an elementwise one is registered: all replicated, or every input
sharded like the output when the shapes match (no broadcasting over a
sharded dim). Ops torch already covers are left alone.
"""

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = [
    "elementwise",
    "flash_cpu",
    "flash_cpu_backward",
    "flash_cpu_backward_ops",
    "flash_cpu_ops",
    "mask_partial_hash",
    "missing_comparisons",
    "register_elementwise",
]

_aten = torch.ops.aten


def mask_partial_hash(self):
    """`_MaskPartial.__hash__` without a memory address in it."""
    return 1 + hash((self.reduce_op, tuple(self.offset_shape), self.offset_dim))


def _per_row_or_head(num_outputs, num_tensors, num_scalars, attn_mask):
    """Strategies: all replicated, or all sharded on dim 0 or dim 1."""
    strategies = []
    for placement in (Replicate(), Shard(0), Shard(1)):
        if attn_mask is not None and isinstance(placement, Shard):
            # A mask broadcast along the sharded dim stays replicated.
            mask = placement if attn_mask.shape[placement.dim] > 1 else None
            mask = mask or Replicate()
        else:
            mask = None if attn_mask is None else Replicate()
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
    tensors = [self] + ([other] if hasattr(other, "shape") else [])
    scalars = 0 if len(tensors) == 2 else 1
    strategies = [
        ([Replicate()], [Replicate()] * len(tensors) + [None] * scalars)
    ]
    if all(tuple(t.shape) == tuple(self.shape) for t in tensors):
        for dim in range(len(self.shape)):
            shard = Shard(dim)
            strategies.append(
                ([shard], [shard] * len(tensors) + [None] * scalars)
            )
    return strategies


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _has_strategy(op):
    """Whether torch's DTensor has a sharding rule of its own for `op`."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = (
        "op_strategy_funcs",
        "op_single_dim_strategy_funcs",
        "op_to_rules",
    )
    return any(op in getattr(propagator, table, {}) for table in tables)


def missing_comparisons():
    """The comparison overloads torch's DTensor has no strategy for."""
    ops = []
    for name in _COMPARISONS:
        for overload in ("Tensor", "Scalar"):
            op = getattr(getattr(_aten, name), overload)
            if not _has_strategy(op):
                ops.append(op)
    return ops


def flash_cpu_ops():
    """The CPU flash-attention forward op."""
    return [_aten._scaled_dot_product_flash_attention_for_cpu.default]


def flash_cpu_backward_ops():
    """The CPU flash-attention backward op."""
    return [_aten._scaled_dot_product_flash_attention_for_cpu_backward.default]


def register_elementwise(ops):
    """Gives each op in `ops` the elementwise strategy, outside the table.

    For tests only: they pass ops torch already covers, to run the fallback
    on a torch that needs none (in a process of their own).
    """
    for op in ops:
        register_sharding(op)(elementwise)
