"""Every layer call under a distribution, handed to its strategy;
`SeedGenerator.next` in the global-values scope."""

from torch.distributed.tensor import DTensor

from keras_dtensor import data_parallel
from keras_dtensor import model_parallel
from keras_dtensor.backend import context

__all__ = ["wrap_call", "wrap_seed_generator_next"]


def wrap_seed_generator_next(original):
    """Wraps `SeedGenerator.next`: a DTensor state as a global value."""

    def next(self, *args, **kwargs):
        if not isinstance(getattr(self.state, "_value", None), DTensor):
            return original(self, *args, **kwargs)
        with context.global_values():
            return original(self, *args, **kwargs)

    return next


def wrap_call(original):
    """Wraps `Layer.__call__`: each call handed to its strategy."""

    def __call__(self, *args, **kwargs):
        distribution = context.active()
        if distribution is None:
            return original(self, *args, **kwargs)
        if context.is_data_parallel(distribution):
            return data_parallel.call_layer(self, original, args, kwargs)
        return model_parallel.call_layer(
            self, original, args, kwargs, distribution
        )

    return __call__
