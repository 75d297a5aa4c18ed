"""Sharding strategies for torch ops that DTensor lacks.

Registered once into DTensor's sharding propagator (public experimental
`register_sharding`); they only affect ops whose inputs are DTensors.

CPU flash attention (`torch.nn.functional.scaled_dot_product_attention` on
CPU, which Keras's `MultiHeadAttention` calls) has no strategy in torch
2.13, so head-parallel attention crashes in backward. Attention is
independent per batch row and per head: with q/k/v/out all sharded on the
batch dimension (0) or the head dimension (1), the op runs on local
shards, exactly like the single-device op on a slice.
"""

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["register_strategies"]

_aten = torch.ops.aten
_registered = []


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


def register_strategies():
    """Registers the strategies above (idempotent)."""
    if _registered:
        return
    register_sharding(
        _aten._scaled_dot_product_flash_attention_for_cpu.default
    )(_flash_cpu)
    register_sharding(
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    )(_flash_cpu_backward)
    _registered.append(True)
