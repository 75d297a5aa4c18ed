"""Keras 3.16's own torch distribution stood down (no DDP wrapper)."""

import weakref

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
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
    """`Trainer.ddp_model`: the trainer then runs `loss.backward()`."""

    def __init__(self, model):
        self._model = weakref.ref(model)

    def __call__(self, *args, **kwargs):
        return self._model()(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        return self._model().zero_grad(*args, **kwargs)


def wrap_initialize_ddp(original):
    """Wraps `Trainer._initialize_ddp`: no DDP wrapper while installed."""

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
    """Wraps `Trainer.get_metrics_result`: the base trainer's (global)."""

    def get_metrics_result(self):
        import torch.distributed as dist

        if context.current() is None and not (
            dist.is_available() and dist.is_initialized()
        ):
            return original(self)
        return compat.base_trainer_class().get_metrics_result(self)

    return get_metrics_result


def wrap_initialize_distributed(original):
    """Wraps `Variable._initialize_distributed`: lays out nothing."""

    def _initialize_distributed(self, initializer):
        if context.current() is None:
            return original(self, initializer)

    return _initialize_distributed


def wrap_distribute_data(original):
    """Wraps `_distribute_data`: the global batch, laid out by the step."""

    def _distribute_data(data, layouts=None):
        if context.current() is None:
            return original(data, layouts)
        convert = compat.torch_core().convert_to_tensor
        return fast_tree.map_structure(
            lambda x: None if x is None else convert(x), data
        )

    return _distribute_data


def wrap_gather_non_batch_axes(original):
    """Wraps `_gather_non_batch_axes`: predictions are global already."""

    def _gather_non_batch_axes(data):
        return original(data) if context.current() is None else data

    return _gather_non_batch_axes
