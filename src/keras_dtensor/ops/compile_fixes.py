"""Compiling over DTensors: the on-disk cache key names the rank, and a
returned view of an input is rebuilt without `as_strided` (which DTensor
refuses) where it is a permutation or a contiguous reshape.
"""

import hashlib

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend.layout import contiguous_strides

__all__ = ["wrap_gen_alias_from_base", "wrap_stable_hash_for_caching"]


def wrap_stable_hash_for_caching(original):
    """Wraps `DTensor._stable_hash_for_caching` (pytorch/pytorch#188390)."""

    def _stable_hash_for_caching(self):
        key = original(self)
        if not torch.distributed.is_initialized():
            return key
        rank = torch.distributed.get_rank()
        salted = f"{key}|rank {rank}|{self._local_tensor.device}"
        return hashlib.blake2b(salted.encode(), digest_size=16).hexdigest()

    return _stable_hash_for_caching


def _view_of(base, target):
    """`target` as `base.permute` or a contiguous `base.view`, or None."""
    if target.dtype != base.dtype:
        return None
    if target.storage_offset() != base.storage_offset():
        return None
    if target.dim() == base.dim():
        # Each (size, stride) of `target` found once in `base`: a permute.
        pairs = list(zip(base.size(), base.stride(), strict=True))
        dims = [
            [i for i, p in enumerate(pairs) if p == pair]
            for pair in zip(target.size(), target.stride(), strict=True)
        ]
        if all(len(found) == 1 for found in dims):
            return base.permute([found[0] for found in dims])
    size = tuple(target.size())
    if (
        target.numel() == base.numel()
        and base.is_contiguous()
        and tuple(target.stride()) == contiguous_strides(size)
    ):
        return base.view(size)
    return None


def wrap_gen_alias_from_base(original):
    """Wraps AOTAutograd's `gen_alias_from_base` (see the module)."""

    def gen_alias_from_base(base, target, target_requires_grad, *a, **kw):
        out = _view_of(base, target) if isinstance(base, DTensor) else None
        if out is None:
            return original(base, target, target_requires_grad, *a, **kw)
        if base.requires_grad and not target_requires_grad:
            out = out.detach()
        elif not base.requires_grad and target_requires_grad:
            out.requires_grad_(True)
        return out

    return gen_alias_from_base
