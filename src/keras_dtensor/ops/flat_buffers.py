"""Tensors packed side by side in flat buffers, grouped in size-capped buckets.

The one packing and bucketing mechanism of every strategy: DataParallel's
gradient buckets, owner broadcasts and parameters stored by owner, the
local run's partial-sum buckets, packed gathers and FSDP groups. A
collective pays a fixed latency that small tensors never amortize, so many
tensors travel as one buffer (DDP's buckets, FSDP2's flat parameters).
Buckets and offsets depend only on the tensors' order, sizes and keys,
which every rank passes alike: the ranks agree on them without
communication.
"""

import math

import torch
import torch.distributed as dist

from keras_dtensor.backend.launch import world

__all__ = [
    "FlatParams",
    "all_reduce_packed",
    "broadcast_packed",
    "buckets",
    "flat_views",
    "nbytes",
    "offsets",
]


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


def offsets(shapes):
    """`(start, size)` of each of `shapes` packed side by side from 0."""
    out, start = [], 0
    for shape in shapes:
        out.append((start, math.prod(shape)))
        start += out[-1][1]
    return out


def flat_views(tensors, room=0):
    """A new flat buffer with a place for each of `tensors` (one dtype and
    device), `room` spare elements after them, and those places as views
    shaped like the tensors. Nothing is copied."""
    places = offsets([t.shape for t in tensors])
    flat = tensors[0].new_empty(sum(places[-1]) + room)
    return flat, [
        flat[start : start + n].view(t.shape)
        for (start, n), t in zip(places, tensors, strict=True)
    ]


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
    out, small, sizes = list(tensors), [], []
    for index, tensor in enumerate(tensors):
        n = tensor.numel() * tensor.element_size()
        if n >= cap:
            for group in groups:
                dist.all_reduce(tensor, group=group)
        else:
            small.append(index)
            sizes.append(n)
    for bucket in buckets(sizes, cap, spill=False):
        members = [small[j] for j in bucket]
        flat, places = flat_views([tensors[i] for i in members])
        for place, i in zip(places, members, strict=True):
            place.copy_(tensors[i])
            out[i] = place
        for group in groups:
            dist.all_reduce(flat, group=group)
    return out


def broadcast_packed(tensors, sources, find=None):
    """Each of `tensors` gets its source rank's value, in place.

    One flat broadcast per (source, dtype), all in flight at once. Every
    rank passes the same shapes, dtypes and sources, in the same order.

    Args:
        tensors: the tensors.
        sources: the rank whose value each tensor gets.
        find: `find((source, dtype), group)` may give a buffer the group's
            tensors already are views of, as `(buffer, [(tensor, its
            view)])` for those stored elsewhere since; else `None`.
    """
    _, rank = world()
    groups = {}
    for tensor, source in zip(tensors, sources, strict=True):
        groups.setdefault((source, tensor.dtype), []).append(tensor)
    pending = []
    with torch.no_grad():
        for key in sorted(groups, key=lambda k: (k[0], str(k[1]))):
            group = groups[key]
            found = find and find(key, group)
            if found:
                flat, pairs = found
            else:
                flat, places = flat_views(group)
                pairs = list(zip(group, places, strict=True))
            if key[0] == rank and pairs:
                torch._foreach_copy_(
                    [v for _, v in pairs], [t.detach() for t, _ in pairs]
                )
            work = dist.broadcast(flat, src=key[0], async_op=True)
            pending.append((key[0], pairs, work))
        for source, pairs, work in pending:
            work.wait()
            if source != rank and pairs:
                torch._foreach_copy_(
                    [t for t, _ in pairs], [v for _, v in pairs]
                )


class FlatParams:
    """Parameters stored as views of one flat buffer per (owner, dtype), so
    a `broadcast_packed` from their owners goes straight into them (FSDP's
    flat parameters). The Parameters keep their identity: only their
    storage moves, through `Parameter.data`.

    Args:
        params: torch Parameters.
        owners: the rank whose values each of `params` gets.
    """

    def __init__(self, params, owners):
        groups = {}
        for param, owner in zip(params, owners, strict=True):
            groups.setdefault((owner, param.dtype), []).append(param)
        self.flat = {}  # (owner, dtype) -> the flat buffer
        self.slot = {}  # id(param) -> ((owner, dtype), its view, param)
        with torch.no_grad():
            for key, group in groups.items():
                if any(p.device != group[0].device for p in group):
                    continue
                self.flat[key], places = flat_views(group)
                for param, view in zip(group, places, strict=True):
                    view.copy_(param)
                    param.data = view  # frees the old storage
                    self.slot[id(param)] = (key, view, param)

    def flat_of(self, key, group):
        """`broadcast_packed`'s `find`: the buffer of `key` and the
        `(tensor, its view)` pairs of `group`'s tensors stored elsewhere
        since, when every tensor of `group` is one of its parameters (the
        others hold the same value on every rank); else `None`."""
        flat = self.flat.get(key)
        if flat is None:
            return None
        moved = []
        for tensor in group:
            slot = self.slot.get(id(tensor))
            if slot is None or slot[0] != key or slot[2] is not tensor:
                return None
            if not tensor.is_set_to(slot[1]):
                moved.append((tensor, slot[1]))
        return flat, moved

    def release(self):
        """Gives every parameter still in a buffer storage of its own."""
        with torch.no_grad():
            for _, view, param in self.slot.values():
                if param.is_set_to(view):
                    param.data = view.clone()
        self.flat.clear()
        self.slot.clear()
