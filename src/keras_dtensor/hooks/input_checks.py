"""Cross-rank input checks: every rank feeds the same steps (the same
global batches, or as many of its own), else an error on every rank
instead of wrong rows or a hang.
"""

import itertools
import zlib

import numpy as np
import torch

from keras_dtensor import config
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend.batch_layout import batch_shard
from keras_dtensor.backend.launch import all_gather_ints

__all__ = ["checked"]


def _uneven_error(counts, global_batches):
    low = min(counts)
    done = [r for r, c in enumerate(counts) if c == low]
    more = [r for r, c in enumerate(counts) if c != low]
    if global_batches:
        how = (
            "With auto_shard_dataset=True (the default) every process must "
            "yield the same global batches"
        )
        fix = "Give every process the same dataset"
    else:
        how = (
            "With auto_shard_dataset=False each process feeds its own data, "
            "and every process must yield the same number of batches"
        )
        fix = (
            "Even out the per-process data, or let keras-dtensor shard one "
            "global dataset"
        )
    return RuntimeError(
        f"{how}: ranks {done} have {low} batches this epoch while ranks "
        f"{more} have more (batches per rank: {counts}). {fix}."
    )


_SAMPLE = 1 << 16
_END = object()  # the iterator is done


def _sample(flat):
    """At most `_SAMPLE` evenly spaced elements: the cost of a checksum
    does not grow with the batch."""
    step = max(1, len(flat) // _SAMPLE)
    return flat[::step]


def _digest(batch):
    """A checksum of a batch's numeric contents (-1 for no batch)."""
    if batch is None:
        return -1
    shard = batch_shard(batch)
    if shard is not None:  # a shard: the global batch's indices
        return shard.digest
    crc = 0
    for leaf in fast_tree.flatten(batch):
        if isinstance(leaf, torch.Tensor):  # any dtype, bfloat16 too
            crc = zlib.crc32(repr(tuple(leaf.shape)).encode(), crc)
            raw = _sample(leaf.detach().reshape(-1)).contiguous()
            leaf = raw.cpu().view(torch.uint8).numpy()
        leaf = np.asarray(leaf)
        if leaf.dtype.kind not in "biufc":  # None, strings: skipped
            continue
        raw = np.ascontiguousarray(_sample(leaf.reshape(-1)))
        crc = zlib.crc32(raw.tobytes(), crc)
        crc = zlib.crc32(repr(leaf.shape).encode(), crc)
    return crc


def _raise_if_batches_differ(digests, index):
    if len(set(digests)) == 1:
        return
    groups = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    raise RuntimeError(
        "With auto_shard_dataset=True (the default) every process must "
        "yield the same global batches, and each keeps its own rows; here "
        f"the processes' batch {index} of this epoch differs (ranks with "
        f"equal batches: {sorted(groups.values())}). Seed every source of "
        "randomness in the input pipeline the same way on every rank "
        "(keras.utils.set_random_seed(seed) before building it, or explicit "
        "seeds), or, if each process deliberately feeds its own rows, "
        "create the distribution with auto_shard_dataset=False "
        "(DataParallel(auto_shard_dataset=False), likewise ModelParallel), "
        "not a fit argument. (A rank that is not running this same "
        "fit/evaluate/predict at all shows up here too: every rank must "
        "call it.)"
    )


def checked(iterator, num_batches, same_batches):
    """`iterator`'s batches, as many on every rank (known counts compared
    once, unknown ones batch by batch); with `same_batches`, the same ones
    (checksums on the first, then every `KERAS_DTENSOR_CHECK_EVERY`)."""
    # iter() now, as Keras does: a DataLoader draws its seed there.
    return _checked(iter(iterator), num_batches, same_batches)


def _checked(iterator, num_batches, same_batches):
    counts = all_gather_ints(-1 if num_batches is None else num_batches)
    known = all(c >= 0 for c in counts)
    if known and len(set(counts)) > 1:
        raise _uneven_error(counts, same_batches)
    every = config.get("CHECK_EVERY") if same_batches else 0
    for index in itertools.count():
        batch = next(iterator, _END)
        compare = same_batches and (
            index == 0 or (every and index % every == 0)
        )
        if not known or compare:
            mine = _digest(batch) if compare and batch is not _END else 0
            digests = all_gather_ints(-1 if batch is _END else mine)
            ended = [d == -1 for d in digests]
            if all(ended):
                return
            if any(ended):
                raise _uneven_error(
                    [index + (not e) for e in ended], same_batches
                )
            if compare:
                _raise_if_batches_differ(digests, index)
        elif batch is _END:
            return
        yield batch
