"""Tensors packed side by side in flat buffers, in size-capped buckets: the
one packer of every strategy. Buckets and offsets depend only on what every
rank passes alike, so ranks agree on them without communication.
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
    """Consecutive runs of items of bytes `sizes`, as index lists, each of
    one key; with `spill` a bucket closes once it holds `cap` or more
    (DDP's rule), else before an item would take it past `cap`."""
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
    """A new flat buffer for `tensors` (and `room`), and views shaped so."""
    places = offsets([t.shape for t in tensors])
    flat = tensors[0].new_empty(sum(places[-1]) + room)
    return flat, [
        flat[start : start + n].view(t.shape)
        for (start, n), t in zip(places, tensors, strict=True)
    ]


def all_reduce_packed(tensors, groups, cap):
    """`tensors` (one dtype and device) summed over each of `groups`, in
    buckets of at most `cap` bytes (a larger one alone, in place)."""
    out, small, sizes = list(tensors), [], []
    for index, tensor in enumerate(tensors):
        n = nbytes(tensor)
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
    """Each of `tensors` gets the value of its rank in `sources`, in place:
    one flat broadcast per (source, dtype), all in flight at once.
    `find((source, dtype), group)` may give the buffer the group's tensors
    are views of, as `(buffer, [(tensor, its view) if moved since])`."""
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
    """`params` as views of one buffer per (owner, dtype), to broadcast."""

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
        """`broadcast_packed`'s `find` for groups of these parameters."""
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
        """Gives every parameter still in a buffer its own storage."""
        with torch.no_grad():
            for _, view, param in self.slot.values():
                if param.is_set_to(view):
                    param.data = view.clone()
        self.flat.clear()
        self.slot.clear()
