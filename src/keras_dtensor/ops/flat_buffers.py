"""Tensors packed side by side in flat buffers, grouped in size-capped buckets.

The one packing and bucketing mechanism of every strategy: DataParallel's
gradient buckets and parameters stored by owner, the local run's
partial-sum gradient buckets and packed shard gathers. A collective pays
a fixed latency that small tensors never amortize, so many tensors travel
as one buffer (DDP's buckets, FSDP2's flat parameters). Buckets and
offsets depend only on the tensors' order, sizes and keys, which every
rank passes alike: the ranks agree on them without communication.
"""

import math

import torch.distributed as dist

__all__ = ["all_reduce_packed", "buckets", "flat_views", "nbytes", "views"]


def nbytes(tensor):
    """The bytes of `tensor`'s elements."""
    return tensor.numel() * tensor.element_size()


def buckets(sizes, cap, keys=None, first_cap=None, spill=True):
    """Consecutive runs of items, as lists of their indices.

    Args:
        sizes: each item's bytes, in the order the buckets follow.
        cap: bucket capacity in bytes.
        keys: a bucket holds items of one key (default: all one).
        first_cap: the first bucket's capacity (default `cap`): a small
            one starts the first collective early.
        spill: a bucket closes once it holds `cap` bytes or more (DDP's
            rule); else an item that would take it past `cap` opens the
            next one.
    """
    keys = keys or [None] * len(sizes)
    out, current, size, limit = [], [], 0, first_cap or cap
    for index, n in enumerate(sizes):
        full = size >= limit if spill else size + n > limit
        if current and (full or keys[index] != keys[current[0]]):
            out.append(current)
            current, size, limit = [], 0, cap
        current.append(index)
        size += n
    if current:
        out.append(current)
    return out


def views(flat, shapes):
    """Consecutive views of `flat`, from its start, shaped as `shapes`."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def flat_views(tensors, room=0):
    """A new flat buffer with a place for each of `tensors` (one dtype and
    device), `room` spare elements after them, and those places as views
    shaped like the tensors. Nothing is copied."""
    flat = tensors[0].new_empty(sum(t.numel() for t in tensors) + room)
    return flat, views(flat, [t.shape for t in tensors])


def all_reduce_packed(tensors, groups, cap):
    """`tensors` (one dtype and device) summed over each of `groups`.

    Tensors under `cap` bytes are packed into buckets of at most `cap` and
    summed with one all-reduce per bucket and group; a larger one is
    summed alone, in place. Each element goes through the same sum as an
    all-reduce of its own tensor would give.

    Returns:
        The sums, in order: views of their bucket's buffer, or the tensor
        itself when it was summed alone.
    """
    out = list(tensors)
    small = [i for i, t in enumerate(tensors) if nbytes(t) < cap]
    for tensor in tensors:
        if nbytes(tensor) >= cap:
            for group in groups:
                dist.all_reduce(tensor, group=group)
    sizes = [nbytes(tensors[i]) for i in small]
    for bucket in buckets(sizes, cap, spill=False):
        members = [small[j] for j in bucket]
        flat, places = flat_views([tensors[i] for i in members])
        for place, i in zip(places, members, strict=True):
            place.copy_(tensors[i])
            out[i] = place
        for group in groups:
            dist.all_reduce(flat, group=group)
    return out
