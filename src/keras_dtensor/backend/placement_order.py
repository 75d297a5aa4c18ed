"""Sharding choices that agree across ranks, whatever `PYTHONHASHSEED` is:
hashes of values alone, planner sets in insertion order, and
`order_digest()` compared when the group starts.
"""

import functools
import zlib

from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

__all__ = [
    "InsertionOrderedSet",
    "mask_partial_hash",
    "norm_partial_hash",
    "order_digest",
    "partial_hash",
    "stable_hash",
    "wrap_planner_init",
]


def stable_hash(value) -> int:
    """A hash of str/int/float/tuple values, equal in every process."""
    return zlib.crc32(repr(value).encode())


@functools.cache
def _reduce_op_hash(reduce_op):
    return 1 + stable_hash(reduce_op)


def partial_hash(self):
    """`Partial.__hash__` from the reduce op's value."""
    return _reduce_op_hash(self.reduce_op)


def mask_partial_hash(self):
    """`_MaskPartial.__hash__` with no memory address or string hash."""
    return 1 + stable_hash(
        (self.reduce_op, tuple(self.offset_shape), self.offset_dim)
    )


def norm_partial_hash(self):
    """`_NormPartial.__hash__`: its norm type may be a string (`"fro"`)."""
    return 1 + stable_hash(self.norm_type)


class InsertionOrderedSet(dict):
    """The part of `set` the redistribute planner uses, in insertion order."""

    def add(self, item):
        self[item] = None


def wrap_planner_init(original):
    """Wraps `DTensorRedistributePlanner.__init__`: ordered target sets."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name in (
            "strided_shard_placements_in_target",
            "partial_reduce_ops_in_target",
        ):
            current = getattr(self, name, None)
            if isinstance(current, set):
                setattr(self, name, InsertionOrderedSet.fromkeys(current))

    return __init__


def order_digest() -> int:
    """A digest of how a set of placements iterates in this process."""
    placements = [Shard(0), Partial("sum"), Replicate(), Partial("avg")]
    placements += [Partial("max"), Shard(1), Partial("min")]
    return stable_hash(repr(list(set(placements))))
