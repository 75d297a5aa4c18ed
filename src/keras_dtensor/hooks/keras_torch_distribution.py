"""Keras 3.16's own torch distribution, stood down where keras-dtensor acts.

Keras 3.16 ships a partial torch distribution: its trainer wraps the model
in `DistributedDataParallel` whenever a process group is up, sums metric
variables across processes, lays variables and batches out itself
(`DTensor.from_local` on each process's batch) and gathers predictions per
process.
keras-dtensor does each of these jobs itself, with one process's numbers
(variables laid out in `hooks.variables`, batches in `hooks.data`, gradients
in `data_parallel`, metrics in `data_parallel.metrics`). Running both would
reduce gradients or metrics twice, so while installed each upstream piece
below steps aside; `uninstall()` puts it back.

Every wrapper here but `_initialize_ddp` returns at once to Keras's own
code when no distribution is set, so a plain one-process job on Keras 3.16
runs exactly as Keras wrote it; `_initialize_ddp` never wraps the model in
DDP (with no distribution, each process runs its own job).
"""

import weakref

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import world

__all__ = [
    "wrap_distribute_data",
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
        wanted = (
            distribution is not None
            and context.is_data_parallel(distribution)
            and world()[0] > 1
        )
        current = self.__dict__.get("ddp_model")
        if wanted and not isinstance(current, _DataParallelStandIn):
            object_state.set_on(self, "ddp_model", _DataParallelStandIn(self))
        elif not wanted and current is not None:
            object_state.set_on(self, "ddp_model", None)

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

        convert = compat.torch_core().convert_to_tensor
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
