"""Keras 3.16's own torch distribution, stood down where keras-dtensor acts.

Keras 3.16 ships a partial torch distribution: its trainer wraps the model
in `DistributedDataParallel` whenever a process group is up, sums metric
variables across processes, lays variables and batches out itself
(`DTensor.from_local` on each process's batch) and gathers predictions per
process; `dot_product_attention` runs DTensors on their local shards.
keras-dtensor does each of these jobs itself, with one process's numbers
(variables laid out in `hooks.variables`, batches in `hooks.data`, gradients
in `data_parallel`, metrics in `data_parallel.metrics`). Running both would
reduce gradients or metrics twice, so while installed each upstream piece
below steps aside; `uninstall()` puts it back.

Every wrapper here returns at once to Keras's own code when no distribution
is set, so a plain one-process job on Keras 3.16 runs exactly as Keras wrote
it.
"""

import weakref

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import world

__all__ = [
    "wrap_distribute_data",
    "wrap_dot_product_attention",
    "wrap_gather_non_batch_axes",
    "wrap_get_metrics_result",
    "wrap_initialize_ddp",
    "wrap_initialize_distributed",
]


class _DataParallelStandIn:
    """What `Trainer.ddp_model` holds under keras-dtensor's `DataParallel`.

    Keras 3.16's train step differentiates with `loss.backward()` when
    `ddp_model` is set (DDP's gradient hooks need `.grad`), and with
    `torch.autograd.grad` in a compiled step otherwise, which fires no
    post-accumulate-grad hook. keras-dtensor's gradient reducer stands
    where DDP would, and its hooks need the same `backward()`: so the
    trainer is given this stand-in, which calls the model itself.
    """

    def __init__(self, model):
        self._model = weakref.ref(model)

    def __call__(self, *args, **kwargs):
        return self._model()(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        return self._model().zero_grad(*args, **kwargs)


def wrap_initialize_ddp(original):
    """Wraps `Trainer._initialize_ddp`: no DDP wrapper while installed.

    Keras 3.16 wraps the model in DDP under `DataParallel` and under no
    distribution whenever a process group is up; keras-dtensor's
    `DataParallel` reduces gradients in buckets itself (the trainer gets
    `_DataParallelStandIn` in DDP's place, on more than one process), and
    a job with no distribution is one process's job on every rank.
    """

    def _initialize_ddp(self):
        distribution = context.active()
        stand_in = None
        if (
            distribution is not None
            and context.is_data_parallel(distribution)
            and world()[0] > 1
        ):
            stand_in = self.ddp_model
            if not isinstance(stand_in, _DataParallelStandIn):
                stand_in = _DataParallelStandIn(self)
        if self.__dict__.get("ddp_model") is not stand_in:
            object_state.set_on(self, "ddp_model", stand_in)

    return _initialize_ddp


def wrap_get_metrics_result(original):
    """Wraps the torch `Trainer.get_metrics_result`: the base trainer's.

    Keras 3.16 sums every metric variable across the process group here;
    keras-dtensor's metrics are already global values (`data_parallel`
    sums them once, in `BaseTrainer.get_metrics_result`).
    """

    def get_metrics_result(self):
        if context.current() is None and not _process_group_up():
            return original(self)
        return compat.base_trainer_class().get_metrics_result(self)

    return get_metrics_result


def _process_group_up():
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def wrap_initialize_distributed(original):
    """Wraps `Variable._initialize_distributed`: keras-dtensor lays out
    variables (`hooks.variables`), so Keras's own path lays out none."""

    def _initialize_distributed(self, initializer):
        if context.current() is None:
            return original(self, initializer)
        return None

    return _initialize_distributed


def wrap_distribute_data(original):
    """Wraps the torch trainer's `_distribute_data`.

    Keras 3.16 turns each process's batch into a DTensor with
    `DTensor.from_local` under `ModelParallel` (each process's arrays taken
    as its shard: N times the global batch). Here the arrays stay the
    global batch, converted to tensors, and the step lays them out.
    """

    def _distribute_data(data, layouts=None):
        if context.current() is None:
            return original(data, layouts)
        from keras.src import tree

        convert = compat.keras_module("torch_core").convert_to_tensor
        return tree.map_structure(
            lambda x: None if x is None else convert(x), data
        )

    return _distribute_data


def wrap_gather_non_batch_axes(original):
    """Wraps the torch trainer's `_gather_non_batch_axes`: predictions are
    already global values on every process."""

    def _gather_non_batch_axes(data):
        if context.current() is None:
            return original(data)
        return data

    return _gather_non_batch_axes


def wrap_dot_product_attention(original):
    """Wraps Keras 3.16's torch `dot_product_attention`.

    On a DTensor query it runs attention on each process's local shards and
    rewraps the output with the query's placements. That holds only where
    every input is split the same way over batch or heads: a pending
    `Partial` sum, a split sequence or feature dim, or inputs placed
    differently give wrong numbers with no error. Such inputs are
    redistributed to replicated first (correct; the heads-split case keeps
    its local run).
    """

    def dot_product_attention(query, key, value, bias=None, mask=None, *a, **k):
        from torch.distributed.tensor import DTensor

        tensors = (query, key, value, bias, mask)
        if not any(isinstance(t, DTensor) for t in tensors):
            return original(query, key, value, bias, mask, *a, **k)
        if not _local_run_valid(tensors):
            query, key, value, bias, mask = (
                _replicated(t) if isinstance(t, DTensor) else t for t in tensors
            )
        return original(query, key, value, bias, mask, *a, **k)

    return dot_product_attention


def _local_run_valid(tensors):
    """Whether attention on local shards gives the global result.

    Query, key and value must be DTensors on one mesh with the same
    placements, each `Shard(0)` (batch), `Shard(2)` (heads, in Keras's
    (batch, seq, heads, dim) layout) or `Replicate()`. A mask or bias
    (broadcast to (batch, heads, seq, seq)) must be split over a mesh dim
    where the query is, along the same axis, unless it has size 1 there
    (it broadcasts): then every process uses the whole of it.
    """
    from torch.distributed.tensor import DTensor

    query, key, value, bias, mask = tensors
    for t in (query, key, value):
        if not isinstance(t, DTensor):
            return False
        if t.device_mesh != query.device_mesh:
            return False
        if tuple(t.placements) != tuple(query.placements):
            return False
    split = [p for p in query.placements if not p.is_replicate()]
    if any(not (p.is_shard(0) or p.is_shard(2)) for p in split):
        return False
    return all(_mask_follows(query, t) for t in (bias, mask) if t is not None)


def _mask_follows(query, mask):
    """Whether each process's part of `mask` is the mask of its query
    shard (see `_local_run_valid`)."""
    from torch.distributed.tensor import DTensor

    # The query's batch and heads axes, as axes of the mask (None: absent,
    # broadcast).
    ndim = mask.ndim
    axis_of = {0: ndim - 4 if ndim >= 4 else None, 2: ndim - 3}
    if isinstance(mask, DTensor):
        if mask.device_mesh != query.device_mesh:
            return False
        placements = mask.placements
    else:
        placements = [None] * len(query.placements)
    for q, m in zip(query.placements, placements, strict=True):
        if m is not None and m.is_partial():
            return False
        if q.is_replicate():
            if m is not None and not m.is_replicate():
                return False
            continue
        axis = axis_of[q.dim]
        if axis is None or axis < 0 or mask.shape[axis] == 1:
            if m is not None and not m.is_replicate():
                return False  # (a size-1 axis is never split)
        elif m is None or not m.is_shard(axis):
            return False
    return True


def _replicated(tensor):
    from torch.distributed.tensor import Replicate

    return tensor.redistribute(
        tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim
    )
