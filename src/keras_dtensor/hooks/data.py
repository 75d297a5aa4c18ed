"""Where batches become DTensors: every input kind is the global batch on
every process, each keeping its rows (loaded alone where `loader_shards`,
`pydataset_shards` can); with `auto_shard_dataset=False`, its own.
"""

import functools
import warnings

from keras_dtensor import compat
from keras_dtensor import data_parallel
from keras_dtensor import planning
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend import resume
from keras_dtensor.backend.batch_layout import distribute_batch
from keras_dtensor.backend.launch import world
from keras_dtensor.hooks import input_checks
from keras_dtensor.hooks import loader_shards
from keras_dtensor.hooks import pydataset_shards

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
        if iterator is None:
            iterator = adapter.get_torch_dataloader()
        iterator = input_checks.checked(
            iterator, adapter.num_batches, same_batches=not per_process
        )
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
        return pydataset_shards.sharded_batches(adapter, distribution)
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
    """Wraps `TorchEpochIterator.__iter__`: a resumed epoch starts at its
    checkpoint's batch (`backend.resume`)."""

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
    """Wraps `TorchTrainer.make_{kind}_function`: plain inputs (such as
    `train_on_batch`'s) laid out as global values."""
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
    """Wraps `data_adapters.get_data_adapter`: built as for one process
    (the global batch; rows kept later), not Keras's tf.data-only split."""

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
            pydataset_shards.take_over_workers(adapter, distribution)
        return adapter

    return _get_data_adapter
