"""Every layer call under a distribution, handed to its strategy.

`Layer.__call__` goes to `data_parallel.call_layer` under `DataParallel`
and to `model_parallel.call_layer` under every other distribution; with
none set it is Keras's own call. `SeedGenerator.next` runs in the
global-values scope (see `context.global_values`).
"""

from torch.distributed.tensor import DTensor

from keras_dtensor import data_parallel
from keras_dtensor import model_parallel
from keras_dtensor.backend import context

__all__ = ["wrap_call", "wrap_seed_generator_next"]


def wrap_seed_generator_next(original):
    """Wraps `SeedGenerator.next`: its state is a replicated variable under
    a distribution and its increment a plain tensor, a global value (see
    `context.global_values`), also when user code draws outside layers
    and steps."""

    def next(self, *args, **kwargs):
        # Only a DTensor state (made under a distribution) meets the plain
        # increment; a plain state has nothing to do here.
        if not isinstance(getattr(self.state, "_value", None), DTensor):
            return original(self, *args, **kwargs)
        with context.global_values():
            return original(self, *args, **kwargs)

    return next


def wrap_call(original):
    """Wraps `Layer.__call__`: inputs of the outermost call, and outputs.

    `model(x)` outside `fit` under a distribution gets the global batch as
    numpy or plain tensors; they become batch-sharded DTensors here, once,
    like the batches of `fit`. Nested layer calls and symbolic (functional
    API) calls are left alone.

    A layer's output that is a partial sum (`Partial`, e.g. after a
    row-parallel matmul) is reduced at the layer boundary, as torch's
    `RowwiseParallel` does: one all-reduce in forward, and backward then
    receives replicated gradients instead of reducing them again.
    """

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
