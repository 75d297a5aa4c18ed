"""Where batches become DTensors; every rank checked to feed the same steps."""

import functools
import itertools
import warnings
import zlib

import numpy as np
import torch

from keras_dtensor import compat
from keras_dtensor import config
from keras_dtensor import data_parallel
from keras_dtensor import planning
from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend import resume
from keras_dtensor.backend.batch_layout import batch_shard
from keras_dtensor.backend.batch_layout import distribute_batch
from keras_dtensor.backend.launch import all_gather_ints
from keras_dtensor.backend.launch import world
from keras_dtensor.hooks import loader_shards

__all__ = [
    "wrap_epoch_iter",
    "wrap_get_data_adapter",
    "wrap_get_iterator",
    "wrap_make_function",
]


def wrap_get_iterator(original):
    """Wraps `TorchEpochIterator._get_iterator`: batches become DTensors."""

    def _get_iterator(self):
        distribution = context.active()
        if distribution is None:
            if context.current() is None:
                return original(self)
            # Keras's loader (3.16's ModelParallel iterator shuffles apart).
            return self.data_adapter.get_torch_dataloader()
        adapter = self.data_adapter
        per_process = not distribution.auto_shard_dataset
        iterator = None if per_process else _own_shards(adapter, distribution)
        iterator = iterator or adapter.get_torch_dataloader()
        # iter() now, as Keras does: a DataLoader draws its seed there.
        iterator = _checked(iter(iterator), adapter.num_batches, per_process)
        if context.is_data_parallel(distribution):
            return iterator  # local mode: the step function takes its rows
        return (
            distribute_batch(batch, distribution, per_process)
            for batch in iterator
        )

    return _get_iterator


def _own_shards(adapter, distribution):
    """This process's shards of the global batches, or `None` (read whole)."""
    if isinstance(adapter, compat.data_adapter_class("TorchDataLoaderAdapter")):
        return loader_shards.sharded_loader(
            adapter.get_torch_dataloader(), distribution
        )
    if isinstance(adapter, compat.data_adapter_class("PyDatasetAdapter")):
        return loader_shards.sharded_batches(adapter, distribution)
    tf_data = compat.data_adapter_class("TFDatasetAdapter")
    if isinstance(adapter, tf_data) and world()[0] > 1:
        _say_read_whole()
    return None


@functools.cache
def _say_read_whole():
    warnings.warn(
        f"keras-dtensor: each of the {world()[0]} processes reads this "
        "tf.data pipeline whole (its maps run on every element in every "
        "process) and keeps its rows of each global batch. A map-style "
        "torch DataLoader or a PyDataset is loaded 1/N per process; or "
        "shard the pipeline per process yourself and pass "
        "auto_shard_dataset=False to the distribution.",
        stacklevel=2,
    )


def wrap_epoch_iter(original):
    """Wraps `TorchEpochIterator.__iter__`: a resumed epoch's start."""

    def __iter__(self):
        pending = resume.take()
        if pending is None:
            return original(self)
        # Before the iterator exists: the adapter seeds its shuffle with it.
        resume.count_epochs_read(self, pending.epochs_read)
        iterator = original(self)
        if not pending.batches:
            return iterator
        positioned, kind = resume.positionable(self)
        if positioned:
            for _ in range(pending.batches):
                next(iterator)  # the same batches, read and dropped
        pending.done(positioned, kind)
        return iterator

    return __iter__


def wrap_make_function(original, kind):
    """Wraps `TorchTrainer.make_{kind}_function`: plain inputs laid out."""
    attribute = f"{kind}_function"

    def make_function(self, force=False):
        result = original(self, force)
        step = getattr(self, attribute)
        if step is None or object_state.get_on(self, attribute) is step:
            return result
        distribution = context.current()
        if distribution is not None and kind == "train":
            planning.warn_unmatched_layout_keys(self, distribution)

        def distributed_step(data):
            distribution = context.active()
            if distribution is None:
                return step(data)
            if context.is_data_parallel(distribution):
                return data_parallel.run_step(
                    self, step, kind, data, distribution
                )
            data = distribute_batch(data, distribution)
            with context.global_values():
                logs = step(data)
            if kind == "train":
                # Applied gradients dropped now, not after the next forward.
                self.zero_grad(set_to_none=True)
            return logs

        return object_state.set_on(self, attribute, distributed_step)

    return make_function


def wrap_get_data_adapter(original):
    """Wraps `data_adapters.get_data_adapter`: built as for one process."""

    def _get_data_adapter(x, *args, **kwargs):
        distribution = context.current()
        if (
            distribution is None
            or not getattr(distribution, "_is_multi_process", False)
            or not distribution.auto_shard_dataset
        ):
            return original(x, *args, **kwargs)
        with object_state.swapped(distribution, "_auto_shard_dataset", False):
            adapter = original(x, *args, **kwargs)
        if isinstance(adapter, compat.data_adapter_class("PyDatasetAdapter")):
            loader_shards.take_over_workers(adapter, distribution)
        return adapter

    return _get_data_adapter


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
            flat = leaf.detach().reshape(-1)
            raw = flat[:: max(1, len(flat) // _SAMPLE)].contiguous()
            leaf = raw.cpu().view(torch.uint8).numpy()
        leaf = np.asarray(leaf)
        if leaf.dtype.kind not in "biufc":  # None, strings: skipped
            continue
        flat = leaf.reshape(-1)  # at most _SAMPLE elements, evenly spaced
        raw = np.ascontiguousarray(flat[:: max(1, len(flat) // _SAMPLE)])
        crc = zlib.crc32(raw.tobytes(), crc)
        crc = zlib.crc32(repr(leaf.shape).encode(), crc)
    return crc


def _batches_differ(digests, index):
    groups = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    return RuntimeError(
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


def _checked(iterator, num_batches, per_process):
    """`iterator`'s batches, as many (or the same) on every rank."""
    same_batches = not per_process
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
            if compare and len(set(digests)) > 1:
                raise _batches_differ(digests, index)
        elif batch is _END:
            return
        yield batch
