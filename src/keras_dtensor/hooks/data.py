"""Where data enters the distributed computation: batches become DTensors.

Keras's single-program semantics hold on every rank: the data a user
passes (arrays, DataLoader, PyDataset, generator, tf.data) is the *global*
batch on every process, and each process keeps its slice along the batch
axis. Where the input allows, a process loads only that slice: a
map-style DataLoader fetches its rows alone (`loader_shards`), a
PyDataset's batches are built 1/N per process and their rows scattered
(`pydataset_shards`); the rest is read whole. With
`auto_shard_dataset=False` each process yields its own slice instead.

Plain tensors are converted here, at the boundary, with the layout they
really have. Nothing downstream guesses that a plain tensor is replicated.
"""

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
            # One process: plain Keras's loader. (Keras 3.16 reads a
            # ModelParallel's batches from another iterator, whose shuffle
            # differs: the numbers would change with the process count.)
            return self.data_adapter.get_torch_dataloader()
        per_process = not distribution.auto_shard_dataset
        if per_process:
            iterator = input_checks.same_number_of_batches(
                self.data_adapter.get_torch_dataloader(),
                self.data_adapter.num_batches,
            )
        else:
            # This process's shards, where the input can load them alone;
            # else the adapter's own global batches (Keras 3.16 would lay
            # them out itself, each process's batch as its shard).
            iterator = _own_shards(self.data_adapter, distribution)
            if iterator is None:
                iterator = self.data_adapter.get_torch_dataloader()
            iterator = input_checks.same_global_batches(
                iterator, self.data_adapter.num_batches
            )
        if context.is_data_parallel(distribution):
            return iterator  # local mode: the step function takes its rows
        return (
            distribute_batch(batch, distribution, per_process)
            for batch in iterator
        )

    return _get_iterator


def _own_shards(adapter, distribution):
    """This process's shards of the adapter's global batches, each loaded
    or built here alone, or `None` where every process reads the input
    whole (`loader_shards`, `pydataset_shards`)."""
    if isinstance(adapter, compat.data_adapter_class("TorchDataLoaderAdapter")):
        derived = loader_shards.sharded_loader(
            adapter.get_torch_dataloader(), distribution
        )
        return None if derived is None else _Shards(derived)
    if isinstance(adapter, compat.data_adapter_class("PyDatasetAdapter")):
        return pydataset_shards.sharded_batches(adapter, distribution)
    if isinstance(adapter, compat.data_adapter_class("TFDatasetAdapter")):
        _say_read_whole(adapter)
    return None


def _say_read_whole(adapter):
    """One warning per process, at the first tf.data input: every process
    runs its pipeline."""
    if _SAID or world()[0] == 1:
        return
    _SAID.append(type(adapter).__name__)
    warnings.warn(
        f"keras-dtensor: each of the {world()[0]} processes reads this "
        "tf.data pipeline whole (its maps run on every element in every "
        "process) and keeps its rows of each global batch. A map-style "
        "torch DataLoader or a PyDataset is loaded 1/N per process; or "
        "shard the pipeline per process yourself and pass "
        "auto_shard_dataset=False to the distribution.",
        stacklevel=2,
    )


_SAID = []  # the inputs already said to be read whole


class _Shards:
    """A sharded loader's tagged shards, re-iterable like the loader."""

    def __init__(self, derived):
        self.derived = derived

    def __iter__(self):
        # The loader's iterator now, not at the first batch: it draws its
        # seed when made, and Keras makes (and drops) one at each epoch's
        # end, which must draw as the user's loader would.
        return loader_shards.shards(iter(self.derived))


def wrap_epoch_iter(original):
    """Wraps `TorchEpochIterator.__iter__`: a resumed epoch starts at the
    batch its checkpoint was written at (`backend.resume`)."""

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
    """Wraps `TorchTrainer.make_{train,test,predict}_function`.

    The step functions receive batches from the epoch iterator (already
    DTensors) and from `train_on_batch`/`test_on_batch`/`predict_on_batch`
    (the user's global arrays). Whatever is still plain when a step starts
    is laid out as a global batch, so `y` and `sample_weight` meet
    `y_pred` as DTensors too.

    Args:
        original: the `make_*_function` method.
        kind: `"train"`, `"test"` or `"predict"`.
    """
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
                # Keras's train_step clears gradients after the next
                # step's forward: they would sit through it (and between
                # steps) beside its activations. Applied, they are dropped.
                self.zero_grad(set_to_none=True)
            return logs

        return object_state.set_on(self, attribute, distributed_step)

    return make_function


def wrap_get_data_adapter(original):
    """Wraps `data_adapters.get_data_adapter`.

    With several processes and `auto_shard_dataset=True`, Keras lets only
    tf.data through, and shards it per process itself (`rebatch` to global
    batch / processes, then `shard`): that needs every global batch to
    divide evenly, and gives ranks different batch counts when the last one
    does not (60 rows in batches of 8 over 2 processes: 8 and 7 batches).
    Here every input kind, tf.data included, yields the global batch on
    every process and `wrap_get_iterator`/the step keeps this process's rows,
    so the adapter is built as for one process. (Each process reads the
    whole input; a pipeline that should read only its own part can shard
    itself and pass `auto_shard_dataset=False`.)
    """

    def _get_data_adapter(x, *args, **kwargs):
        distribution = context.current()
        if (
            distribution is None
            or not getattr(distribution, "_is_multi_process", False)
            or not distribution.auto_shard_dataset
        ):
            return original(x, *args, **kwargs)
        distribution.auto_shard_dataset = False
        try:
            adapter = original(x, *args, **kwargs)
        finally:
            distribution.auto_shard_dataset = True
        if isinstance(adapter, compat.data_adapter_class("PyDatasetAdapter")):
            pydataset_shards.take_over_workers(adapter, distribution)
        return adapter

    return _get_data_adapter
