"""A batch split into balanced per-rank rows, and gathered back."""

import torch
import torch.distributed as dist

from keras_dtensor import compat
from keras_dtensor.backend.launch import all_gather_ints
from keras_dtensor.backend.launch import world

__all__ = [
    "gather_rows",
    "local_rows",
    "rank_counts",
    "row_range",
    "split_counts",
]


def _to_tensor(x):
    return None if x is None else compat.torch_core().convert_to_tensor(x)


def local_rows(batch, distribution, shard=None):
    """`(this process's rows of batch, how many, the global batch's rows)`;
    `batch` already is them with a `shard`, or with
    `auto_shard_dataset=False` (global rows unknown: `None`)."""
    from keras.src import tree

    leaves = [x for x in tree.flatten(batch) if x is not None]
    total = int(leaves[0].shape[0]) if leaves else 0
    if shard is not None or not distribution.auto_shard_dataset:
        local = tree.map_structure(_to_tensor, batch)
        return local, total, None if shard is None else shard.total
    start, length = row_range(total)

    def cut(x):
        return None if x is None else _to_tensor(x)[start : start + length]

    return tree.map_structure(cut, batch), length, total


def split_counts(total):
    """Rows of each rank, in rank order, of a global batch of `total`: the
    first `total % size` ranks get one more."""
    size, _ = world()
    return [total // size + (rank < total % size) for rank in range(size)]


def rank_counts(rows, global_rows):
    """Every rank's rows, in rank order: split from `global_rows`, or
    gathered when it is `None`."""
    if global_rows is None:
        return all_gather_ints(rows)
    return split_counts(global_rows)


def row_range(total):
    """`(start, length)` of this process's rows of a global batch."""
    counts = split_counts(total)
    rank = world()[1]
    return sum(counts[:rank]), counts[rank]


def gather_rows(outputs, counts):
    """Each rank's rows of `outputs` (nested) all-gathered in global order;
    `counts`: every rank's rows, in rank order."""
    from keras.src import tree

    widest = max(counts)

    def gather(x):
        padded = x.new_zeros((widest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(
            [part[:n] for part, n in zip(parts, counts, strict=True)]
        )

    return tree.map_structure(gather, outputs)
