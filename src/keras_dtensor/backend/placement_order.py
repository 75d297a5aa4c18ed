"""Sharding choices that agree across ranks, whatever `PYTHONHASHSEED` is.

Every rank must choose the same sharding strategy for an op, or the ranks
run different collectives and the job dies ("collective mismatch") or
hangs. DTensor's strategy search breaks cost ties by the order in which it
enumerates candidates, and in torch 2.13 and 2.14 some of those come out of
Python sets:

- sets of placements (`_get_unique_placements`, the allowed partials per
  input of a single-dim strategy), ordered by `Placement.__hash__`.
  `Shard`, `_StridedShard` and `Replicate` hash integers, the same in
  every process; `Partial` hashes its reduce-op *string*, and Python
  salts string hashes per process (`PYTHONHASHSEED`); `_MaskPartial`
  also hashes `id(mask_buffer)`, a memory address.
- the redistribute planner's sets of target reduce-op strings and strided
  shards (`DTensorRedistributePlanner`), when a target mixes reduce ops.

The hashes below depend on the placement's value alone (a CRC of its
`repr`), so sets of placements iterate in the same order on every rank;
the planner's sets are replaced by insertion-ordered ones. Launching with
plain `torchrun train.py` is then safe, and `order_digest()` is compared
across ranks when the process group starts, in case the hashes are not
in effect.
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
    """A hash of str/int/float/tuple values, equal in every process.

    Example:
    >>> stable_hash(("sum", (8, 4), 0)) == stable_hash(("sum", (8, 4), 0))
    True
    """
    return zlib.crc32(repr(value).encode())


@functools.cache
def _reduce_op_hash(reduce_op):
    return 1 + stable_hash(reduce_op)


def partial_hash(self):
    """`Partial.__hash__` from the reduce op's value, not its string hash.

    Cached per reduce op: DTensor hashes placements on every dispatch.
    """
    return _reduce_op_hash(self.reduce_op)


def mask_partial_hash(self):
    """`_MaskPartial.__hash__` without a memory address or a string hash.

    A hash may be coarser than `__eq__` (which compares the mask buffer by
    identity); it only has to agree across ranks.
    """
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
    """A digest of how a set of placements iterates in this process.

    Ranks whose digests differ would break strategy ties differently.
    """
    placements = [
        Shard(0),
        Partial("sum"),
        Replicate(),
        Partial("avg"),
        Partial("max"),
        Shard(1),
        Partial("min"),
    ]
    return stable_hash(repr(list(set(placements))))
