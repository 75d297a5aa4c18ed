"""Compiling over DTensors: torch fixes a compiled forward needs.

torch's on-disk compile cache keys a DTensor the same on every rank, and
the ranks of a machine share that cache: a warm run could load a program
another rank compiled and train different numbers with no error. The key
names the rank (`wrap_stable_hash_for_caching`).

A compiled piece whose output is a view of its input is rebuilt by
AOTAutograd with `as_strided` in torch 2.13 (torch 2.14 replays the
view), an op DTensor refuses and cannot differentiate: Keras's
`MultiHeadAttention` returns a transposed view across a graph break.
Where the view is a permutation of the input's dims, or a reshape of a
contiguous input (keras_hub's Qwen-MoE router), it is rebuilt with
`permute` or `view` instead (`wrap_gen_alias_from_base`).
"""

import hashlib

import torch

from keras_dtensor.backend.layout import contiguous_strides

__all__ = ["wrap_gen_alias_from_base", "wrap_stable_hash_for_caching"]


def wrap_stable_hash_for_caching(original):
    """Wraps `DTensor._stable_hash_for_caching`: the key of a DTensor in
    torch's on-disk AOTAutograd cache, which torch 2.13 derives from the
    DTensor's spec alone (mesh, placements, global shape), the same on
    every rank (pytorch/pytorch#188390; 2.14 adds the local device, the
    same for every rank on CPU). The cache directory is shared by the
    processes of a machine, so a rank could load the program another rank
    compiled: measured, a warm run trained different numbers from eager
    with no error (`test_model_parallel.py`, "jit_warm_cache"). The key
    also names this process's rank: each rank finds its own entries, and
    again in the next run."""

    def _stable_hash_for_caching(self):
        key = original(self)
        if not torch.distributed.is_initialized():
            return key
        rank = torch.distributed.get_rank()
        salted = f"{key}|rank {rank}|{self._local_tensor.device}"
        return hashlib.blake2b(salted.encode(), digest_size=16).hexdigest()

    return _stable_hash_for_caching


def _permutation(target, base):
    """`dims` with `base.permute(dims)` laid out as `target`, or None. Two
    dims with one (size, stride) make it ambiguous (the layouts agree, the
    placements need not): None."""
    pairs = list(zip(base.size(), base.stride(), strict=True))
    dims = []
    for pair in zip(target.size(), target.stride(), strict=True):
        found = [i for i, p in enumerate(pairs) if p == pair]
        if len(found) != 1:
            return None
        dims.append(found[0])
    return dims


def _view_of(base, target):
    """`target` as a differentiable view op on `base` (a permutation of
    its dims, or a reshape of a contiguous base to contiguous `target`),
    or None when it is neither (a slice, a strided view)."""
    if target.dtype != base.dtype:
        return None
    if target.storage_offset() != base.storage_offset():
        return None
    if target.dim() == base.dim():
        dims = _permutation(target, base)
        if dims is not None:
            return base.permute(dims)
    size = tuple(target.size())
    if (
        target.numel() == base.numel()
        and base.is_contiguous()
        and tuple(target.stride()) == contiguous_strides(size)
    ):
        return base.view(size)
    return None


def wrap_gen_alias_from_base(original):
    """Wraps AOTAutograd's `gen_alias_from_base(base, target,
    target_requires_grad, ...)`, which rebuilds a compiled graph's output
    that aliases `base` (see the module docstring). For a DTensor base and
    a target that is a permutation or a reshape of it, the alias is
    `base.permute(dims)` or `base.view(shape)` (differentiable, sharded by
    DTensor's rules); everything else goes to torch's own."""
    from torch.distributed.tensor import DTensor

    def gen_alias_from_base(base, target, target_requires_grad, *a, **kw):
        if not isinstance(base, DTensor):
            return original(base, target, target_requires_grad, *a, **kw)
        out = _view_of(base, target)
        if out is None:
            return original(base, target, target_requires_grad, *a, **kw)
        if base.requires_grad and not target_requires_grad:
            out = out.detach()
        elif not base.requires_grad and target_requires_grad:
            out.requires_grad_(True)
        return out

    return gen_alias_from_base
