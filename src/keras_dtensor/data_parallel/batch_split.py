"""A batch split into balanced per-rank rows, and gathered back."""

import torch
import torch.distributed as dist

from keras_dtensor import compat
from keras_dtensor.backend.launch import all_gather_ints
from keras_dtensor.backend.launch import world

__all__ = [
    "gather_rows",
    "leading_rows",
    "local_rows",
    "row_counts",
    "row_range",
    "split_counts",
]


def _to_tensor(x):
    return None if x is None else compat.torch_core().convert_to_tensor(x)


def local_rows(batch, distribution, shard=None):
    """`(this process's rows of batch, how many)`, maybe none; `batch`
    already is them with `auto_shard_dataset=False` or a `shard`."""
    from keras.src import tree

    leaves = [x for x in tree.flatten(batch) if x is not None]
    if not leaves:
        return batch, 0
    total = int(leaves[0].shape[0])
    if shard is not None or not distribution.auto_shard_dataset:
        return tree.map_structure(_to_tensor, batch), total
    start, length = row_range(total)

    def cut(x):
        return None if x is None else _to_tensor(x)[start : start + length]

    return tree.map_structure(cut, batch), length


def split_counts(total):
    """Rows of each rank, in rank order, of a global batch of `total`: the
    first `total % size` ranks get one more."""
    size, _ = world()
    return [total // size + (rank < total % size) for rank in range(size)]


def row_range(total):
    """`(start, length)` of this process's rows of a global batch."""
    counts = split_counts(total)
    rank = world()[1]
    return sum(counts[:rank]), counts[rank]


def leading_rows(batch):
    """Rows of a batch: the leading dim of its first array."""
    from keras.src import tree

    return int(next(x for x in tree.flatten(batch) if x is not None).shape[0])


def row_counts(batch, distribution, shard=None):
    """Rows every rank computes on, in rank order."""
    if shard is not None:
        return split_counts(shard.total)
    if distribution.auto_shard_dataset:
        return split_counts(leading_rows(batch))
    return all_gather_ints(leading_rows(batch))


def gather_rows(outputs, counts):
    """Each rank's rows of `outputs` (nested) all-gathered in global order;
    `counts`: every rank's rows, in rank order."""
    from keras.src import tree

    size, _ = world()
    if size == 1:
        return outputs
    widest = max(counts)

    def gather(x):
        padded = x.new_zeros((widest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(
            [part[:n] for part, n in zip(parts, counts, strict=True)]
        )

    return tree.map_structure(gather, outputs)
