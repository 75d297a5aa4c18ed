"""DTensor fixes that distributed Keras programs need from torch 2.13.

1. Every rank must choose the same sharding strategy for an op, or the
   ranks run different collectives and the job dies ("Received data size
   doesn't match expected size ... collective mismatch") or hangs.
   DTensor's strategy search breaks cost ties by the iteration order of
   Python sets of placements, which follows their hashes. String hashes
   must agree across ranks (one PYTHONHASHSEED; `launch._check_hash_seed`
   checks it at start); `_MaskPartial.__hash__` also hashes `id(mask_buffer)`,
   a memory address that differs between processes.
   `stable_placement_hashes()` leaves the address out (a hash may be
   coarser than `__eq__`, which compares the buffer by identity). Seen here
   as a vocabulary-sharded Embedding allgathering its table on one rank.

2. Sharding strategies for ops DTensor lacks, registered once through the
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
    "missing_comparisons",
    "register_elementwise",
    "register_strategies",
    "restore_placement_hashes",
    "stable_placement_hashes",
]

_aten = torch.ops.aten
_registered = []
_original_hashes = {}


def _mask_partial_hash(self):
    return 1 + hash((self.reduce_op, tuple(self.offset_shape), self.offset_dim))


def stable_placement_hashes():
    """Gives `_MaskPartial` a hash without a memory address in it."""
    try:
        from torch.distributed.tensor.placement_types import _MaskPartial
    except ImportError:  # torch < 2.10 keeps it with the embedding ops
        from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

    if _MaskPartial not in _original_hashes:
        _original_hashes[_MaskPartial] = _MaskPartial.__dict__["__hash__"]
        _MaskPartial.__hash__ = _mask_partial_hash


def restore_placement_hashes():
    """Puts back torch's own `__hash__` methods."""
    for cls, original in list(_original_hashes.items()):
        cls.__hash__ = original
        del _original_hashes[cls]


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


def _flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, **kwargs):
    # -> (output, logsumexp); inputs q, k, v; scalars dropout_p, is_causal.
    return _per_row_or_head(2, 3, 2, kwargs.get("attn_mask"))


def _flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, **kw
):
    # -> (grad_q, grad_k, grad_v); inputs grad_out, q, k, v, out, lse.
    return _per_row_or_head(3, 6, 2, kw.get("attn_mask"))


def _elementwise(self, other=None, **kwargs):
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


def register_elementwise(ops):
    """Gives each op in `ops` the elementwise strategy above.

    `register_strategies()` passes `missing_comparisons()`; tests pass ops
    torch already covers, to run the fallback on a torch that needs none.
    """
    for op in ops:
        register_sharding(op)(_elementwise)


def register_strategies():
    """Registers the strategies above (idempotent)."""
    if _registered:
        return
    register_elementwise(missing_comparisons())
    register_sharding(
        _aten._scaled_dot_product_flash_attention_for_cpu.default
    )(_flash_cpu)
    register_sharding(
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    )(_flash_cpu_backward)
    _registered.append(True)
