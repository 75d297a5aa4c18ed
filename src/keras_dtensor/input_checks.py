"""Cross-rank input checks: every rank must feed the same steps.

With `auto_shard_dataset=True` every process yields the same global
batches (each keeps its own rows); with `False` each feeds its own, and
all must yield the same number of batches. A difference would train on
the wrong rows with no error, or leave ranks waiting in a collective
forever: these checks turn both into an error on every rank.
"""

import numpy as np
import torch

from keras_dtensor.launch import all_gather_ints

__all__ = ["same_global_batches", "same_number_of_batches"]


def _uneven_error(counts):
    low = min(counts)
    done = [r for r, c in enumerate(counts) if c == low]
    more = [r for r, c in enumerate(counts) if c != low]
    return RuntimeError(
        "With auto_shard_dataset=False each process feeds its own data, and "
        "every process must yield the same number of batches: ranks "
        f"{done} ran out after {low} batches while ranks {more} had more "
        f"(batches per rank: {counts}). Even out the per-process data, or "
        "let keras-dtensor shard one global dataset."
    )


def _digest(batch):
    """A checksum of a batch's numeric contents (-1 for no batch)."""
    import zlib

    from keras.src import tree

    if batch is None:
        return -1
    crc = 0
    for leaf in tree.flatten(batch):
        if leaf is None:
            continue
        if isinstance(leaf, torch.Tensor):  # any dtype, bfloat16 too
            crc = zlib.crc32(repr(tuple(leaf.shape)).encode(), crc)
            raw = leaf.detach().cpu().contiguous().reshape(-1)
            leaf = raw.view(torch.uint8).numpy()
        leaf = np.asarray(leaf)
        if leaf.dtype.kind not in "biufc":  # strings, objects: skipped
            continue
        crc = zlib.crc32(np.ascontiguousarray(leaf).tobytes(), crc)
        crc = zlib.crc32(repr(leaf.shape).encode(), crc)
    return crc


def same_global_batches(iterator):
    """Checks that every rank sees the same first global batch.

    With `auto_shard_dataset=True` every process must yield the same global
    batches (each keeps its own rows). A pipeline that differs per process,
    typically a shuffle seeded differently on each rank, would train on
    overlapping and missing rows with no error: the first batch of every
    epoch is compared (one all-gather of a checksum), and a mismatch raises.
    """
    # iter() now, as Keras does when it prepares the next epoch: a
    # DataLoader draws its seed there, and later would shift the RNG.
    return _checked_first_batch(iter(iterator))


def _checked_first_batch(iterator):
    try:
        first = next(iterator)
    except StopIteration:
        first = None
    digests = all_gather_ints(_digest(first))
    if len(set(digests)) > 1:
        groups = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        raise RuntimeError(
            "With auto_shard_dataset=True (the default) every process must "
            "yield the same global batches, and each keeps its own rows; "
            "here the processes' first batches differ (ranks with equal "
            f"batches: {sorted(groups.values())}). Seed every source of "
            "randomness in the input pipeline the same way on every rank "
            "(keras.utils.set_random_seed(seed) before building it, or "
            "explicit seeds), or, if each process deliberately feeds its "
            "own rows, pass auto_shard_dataset=False."
        )
    if first is None:
        return
    yield first
    yield from iterator


def same_number_of_batches(iterator, num_batches):
    """Checks that every rank yields the same number of per-process batches.

    Each process feeds its own data here; a rank that stopped early would
    leave the others waiting in a collective forever. Known sizes are
    compared once, up front; for unknown sizes (generators, iterable
    datasets) the ranks exchange before each batch whether they have one,
    and all stop together or all raise naming who ran out.
    """
    return _counted_batches(iter(iterator), num_batches)  # iter(): see above


def _counted_batches(iterator, num_batches):
    counts = all_gather_ints(-1 if num_batches is None else num_batches)
    if all(c >= 0 for c in counts):
        if len(set(counts)) > 1:
            raise _uneven_error(counts)
        yield from iterator
        return
    count = 0
    while True:
        try:
            batch, has = next(iterator), 1
        except StopIteration:
            batch, has = None, 0
        flags = all_gather_ints(has)
        if not any(flags):
            return
        if not all(flags):
            raise _uneven_error([count + f for f in flags])
        count += 1
        yield batch
