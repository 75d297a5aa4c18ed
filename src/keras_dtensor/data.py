"""Where data enters the distributed computation: batches become DTensors.

Keras's single-program semantics hold on every rank: the data a user
passes (arrays, DataLoader, PyDataset, generator) yields the *global* batch
on every process, and each process keeps its slice along the batch axis.
With `auto_shard_dataset=False` (or a tf.data dataset that Keras already
sharded per process) each process yields its own slice instead.

Plain tensors are converted here, at the boundary, with the layout they
really have. Nothing downstream guesses that a plain tensor is replicated.
"""

import contextlib

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor import data_parallel

__all__ = [
    "distribute_batch",
    "distribute_call_inputs",
    "epoch_iterator",
    "get_data_adapter",
    "plain_tensors_are_global",
    "seed_generator_next",
    "step_function",
]

_global_depth = [0]


@contextlib.contextmanager
def plain_tensors_are_global():
    """Inside: a plain tensor meeting a DTensor counts as replicated.

    Keras programs are single-program: a tensor that a layer, loss,
    initializer or seed generator creates (`ops.ones`, a dropout mask drawn
    from an agreed seed, a seed increment) holds the same global value on
    every process, so it *is* replicated. Data is the exception (a rank's
    slice is not the global value), and every data path becomes DTensors
    before entering here (`distribute_batch`), so no rank-local tensor is
    mistaken for a global one. Outside these scopes (user code between
    steps) a plain tensor meeting a DTensor still raises torch's "mixed
    torch.Tensor and DTensor" error. Re-entrant, unlike torch's
    `implicit_replication`, which it enters once.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    outermost = _global_depth[0] == 0
    _global_depth[0] += 1
    try:
        with implicit_replication() if outermost else contextlib.nullcontext():
            yield
    finally:
        _global_depth[0] -= 1


def _current_distribution():
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("distribution")


def _data_layout(distribution, ndim):
    """The batch layout for `ndim`, cached on the distribution object."""
    cache = distribution.__dict__.setdefault("_keras_dtensor_data_layouts", {})
    if ndim not in cache:
        from keras_dtensor.distribution_lib import _as_backend_layout

        layout = distribution.get_data_layout((None,) * ndim)
        cache[ndim] = _as_backend_layout(layout)
    return cache[ndim]


def _distribute_leaf(x, distribution, per_process):
    from keras_dtensor.distribution_lib import distribute_data_input
    from keras_dtensor.distribution_lib import shard_global_tensor

    if isinstance(x, DTensor) or x is None:
        return x
    if isinstance(x, np.ndarray) or (
        isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
    ):
        from keras.src.backend.torch.core import convert_to_tensor

        x = convert_to_tensor(x)
        if x.ndim == 0:
            return x
        layout = _data_layout(distribution, x.ndim)
        if per_process:
            return distribute_data_input(x, layout, distribution.batch_dim_name)
        return shard_global_tensor(x, layout)
    return x


def distribute_batch(batch, distribution, per_process=False):
    """Converts every array in a batch to a DTensor sharded by batch.

    Args:
        batch: a nested structure of arrays and tensors.
        distribution: the active `keras.distribution.Distribution`.
        per_process: whether the batch is this process's slice (else it
            is the global batch, identical on every process).

    Returns:
        The same structure with `DTensor` leaves.
    """
    from keras.src import tree

    return tree.map_structure(
        lambda x: _distribute_leaf(x, distribution, per_process), batch
    )


def _all_gather_ints(value):
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered = [
        torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())
    ]
    dist.all_gather(gathered, torch.tensor([value]))
    return [int(g.item()) for g in gathered]


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


def _same_global_batches(iterator):
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
    digests = _all_gather_ints(_digest(first))
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


def _same_number_of_batches(iterator, num_batches):
    """Checks that every rank yields the same number of per-process batches.

    Each process feeds its own data here; a rank that stopped early would
    leave the others waiting in a collective forever. Known sizes are
    compared once, up front; for unknown sizes (generators, iterable
    datasets) the ranks exchange before each batch whether they have one,
    and all stop together or all raise naming who ran out.
    """
    return _counted_batches(iter(iterator), num_batches)  # iter(): see above


def _counted_batches(iterator, num_batches):
    counts = _all_gather_ints(-1 if num_batches is None else num_batches)
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
        flags = _all_gather_ints(has)
        if not any(flags):
            return
        if not all(flags):
            raise _uneven_error([count + f for f in flags])
        count += 1
        yield batch


def epoch_iterator(original):
    """Wraps `TorchEpochIterator._get_iterator`: batches become DTensors."""

    def _get_iterator(self):
        iterator = original(self)
        distribution = _current_distribution()
        if distribution is None:
            return iterator
        per_process = not distribution.auto_shard_dataset
        if per_process:
            iterator = _same_number_of_batches(
                iterator, self.data_adapter.num_batches
            )
        elif getattr(distribution, "_is_multi_process", False):
            iterator = _same_global_batches(iterator)
        if data_parallel.is_local_mode(distribution):
            return iterator  # local mode: the step function takes its rows
        return (
            distribute_batch(batch, distribution, per_process)
            for batch in iterator
        )

    return _get_iterator


def step_function(original, attribute):
    """Wraps `TorchTrainer.make_{train,test,predict}_function`.

    The step functions receive batches from the epoch iterator (already
    DTensors) and from `train_on_batch`/`test_on_batch`/`predict_on_batch`
    (the user's global arrays). Whatever is still plain when a step starts
    is laid out as a global batch, so `y` and `sample_weight` meet
    `y_pred` as DTensors too.

    Args:
        original: the `make_*_function` method.
        attribute: the attribute it sets, e.g. `"train_function"`.
    """

    def make_function(self, force=False):
        result = original(self, force)
        step = getattr(self, attribute)
        if step is None or getattr(step, "_keras_dtensor_step", False):
            return result
        distribution = _current_distribution()
        if distribution is not None and attribute == "train_function":
            from keras_dtensor.variables import warn_unmatched_layout_keys

            warn_unmatched_layout_keys(self, distribution)

        def distributed_step(data):
            distribution = _current_distribution()
            if distribution is None:
                return step(data)
            if data_parallel.is_local_mode(distribution):
                return _local_step(self, step, attribute, data, distribution)
            data = distribute_batch(data, distribution)
            with plain_tensors_are_global():
                return step(data)

        distributed_step._keras_dtensor_step = True
        setattr(self, attribute, distributed_step)
        return distributed_step

    return make_function


def _local_step(model, step, attribute, data, distribution):
    """One step of local-mode data parallelism on this process's rows."""
    (batch,) = data
    if attribute == "predict_function":
        counts = data_parallel.row_counts(batch, distribution)
        local, _ = data_parallel.local_rows(batch, distribution, False)
        return data_parallel.gather_rows(step([local]), counts)
    local, rows = data_parallel.local_rows(batch, distribution)
    if attribute != "train_function" or data_parallel.world_size() == 1:
        return step([local])
    reducer = getattr(model, "_keras_dtensor_reducer", None)
    if reducer is None or reducer.step is not step:
        reducer = data_parallel.prepare_train_step(model)
        reducer.step = step
    # A global batch split here: every rank knows the global row count.
    global_rows = None
    if distribution.auto_shard_dataset:
        global_rows = data_parallel.leading_rows(batch)
    reducer.begin(rows, global_rows)
    try:
        with data_parallel.splitting_updates(reducer.split):
            return step([local])
    finally:
        reducer.active = False


def get_data_adapter(original):
    """Wraps `data_adapters.get_data_adapter`.

    With several processes and `auto_shard_dataset=True`, Keras lets only
    tf.data through, and shards it per process itself (`rebatch` to global
    batch / processes, then `shard`): that needs every global batch to
    divide evenly, and gives ranks different batch counts when the last one
    does not (60 rows in batches of 8 over 2 processes: 8 and 7 batches).
    Here every input kind, tf.data included, yields the global batch on
    every process and `epoch_iterator`/the step keeps this process's rows,
    so the adapter is built as for one process. (Each process reads the
    whole input; a pipeline that should read only its own part can shard
    itself and pass `auto_shard_dataset=False`.)
    """

    def _get_data_adapter(x, *args, **kwargs):
        distribution = _current_distribution()
        if (
            distribution is None
            or not getattr(distribution, "_is_multi_process", False)
            or not distribution.auto_shard_dataset
        ):
            return original(x, *args, **kwargs)
        distribution.auto_shard_dataset = False
        try:
            return original(x, *args, **kwargs)
        finally:
            distribution.auto_shard_dataset = True

    return _get_data_adapter


def seed_generator_next(original):
    """Wraps `SeedGenerator.next`: its state is a replicated variable under
    a distribution and its increment a plain tensor, a global value (see
    `plain_tensors_are_global`), also when user code draws outside layers
    and steps."""

    def next(self, *args, **kwargs):
        with plain_tensors_are_global():
            return original(self, *args, **kwargs)

    return next


def _in_layer_call():
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("current_call_ctx") is not None


def _reduce_partial(x):
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        placements = [
            Replicate() if p.is_partial() else p for p in x.placements
        ]
        return x.redistribute(x.device_mesh, placements)
    return x


def distribute_call_inputs(original):
    """Wraps `Layer.__call__`: inputs of the outermost call, and outputs.

    `model(x)` outside `fit` under a distribution gets the global batch as
    numpy or plain tensors; they become batch-sharded DTensors here, once,
    like the batches of `fit`. Nested layer calls and symbolic (functional
    API) calls are left alone.

    A layer's output that is a pending sum (`Partial`, e.g. after a
    row-parallel matmul) is reduced at the layer boundary, as torch's
    `RowwiseParallel` does: one all-reduce in forward, and backward then
    receives replicated gradients instead of reducing them again.
    """

    def __call__(self, *args, **kwargs):
        from keras.src import tree

        distribution = _current_distribution()
        if distribution is None or data_parallel.is_local_mode(distribution):
            return original(self, *args, **kwargs)
        if _in_layer_call():
            outputs = original(self, *args, **kwargs)
        else:
            args, kwargs = distribute_batch((args, kwargs), distribution)
            with plain_tensors_are_global():
                outputs = original(self, *args, **kwargs)
        return tree.map_structure(_reduce_partial, outputs)

    return __call__
