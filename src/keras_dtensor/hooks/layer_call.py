"""The outermost layer call: plain inputs in, reduced outputs out.

`model(x)` outside `fit` under a distribution gets the global batch as
numpy or plain tensors; the outermost `Layer.__call__` lays them out like
a `fit` batch and runs inside the global-values scope. Layer outputs that
are pending sums are reduced at the layer boundary. `SeedGenerator.next`
runs in the global-values scope too.

Gradients meet the same boundary in backward: a layer output's gradient
that arrives as a pending sum is reduced to the output's own layout there
(see `_reduce_partial_grad`).
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import data_parallel
from keras_dtensor.backend import context
from keras_dtensor.hooks.data import distribute_batch
from keras_dtensor.model_parallel import islands
from keras_dtensor.model_parallel import local_run
from keras_dtensor.model_parallel.fsdp_weights import gathered_weights
from keras_dtensor.model_parallel.islands import reduce_partial

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


def _in_layer_call():
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("current_call_ctx") is not None


def _grad_in_layout(placements, grad):
    """A gradient hook: pending sums reduced to the forward `placements`."""
    if not isinstance(grad, DTensor) or len(grad.placements) != len(placements):
        return grad
    target = [
        forward if grad_p.is_partial() and not forward.is_partial() else grad_p
        for grad_p, forward in zip(grad.placements, placements, strict=True)
    ]
    if target == list(grad.placements):
        return grad
    return grad.redistribute(grad.device_mesh, target)


def _reduce_partial_grad(x):
    """Lays the gradient of layer output `x` out as `x` when it arrives.

    DTensor's implicit redistributions in forward (a sharded activation
    gathered for the next matmul) have no backward, so a matmul's input
    gradient comes back as a pending sum and travels on through the ops
    before it: an embedding's backward, a scatter into the whole table,
    then makes a table-sized pending sum on every rank, reduced only when
    the optimizer lays it out (model (a) of benchmarks/bench_memory.py:
    the full table twice per rank). torch's `ColwiseParallel` reduces it at
    the module's input; here it is reduced where it enters the layer that
    produced `x`, to `x`'s own placements (a reduce-scatter for a sharded
    output), so backward inside a layer sees what its forward produced.
    """
    if (
        isinstance(x, DTensor)
        and x.requires_grad
        and not torch.compiler.is_compiling()
    ):
        x.register_hook(functools.partial(_grad_in_layout, tuple(x.placements)))
    return x


def _reduced(outputs):
    """A layer's outputs with pending sums reduced (and, under autograd,
    their gradients laid out as the outputs when they arrive)."""
    from keras.src import tree

    if torch.is_grad_enabled():
        return tree.map_structure(
            lambda x: _reduce_partial_grad(reduce_partial(x)), outputs
        )
    return tree.map_structure(reduce_partial, outputs)


def wrap_call(original):
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
        distribution = context.active()
        if distribution is None:
            return original(self, *args, **kwargs)
        if context.is_data_parallel(distribution):
            return data_parallel.call_layer(self, original, args, kwargs)
        if not torch.compiler.is_compiling() and local_run.active():
            return local_run.inner_call(self, original, args, kwargs)
        if _in_layer_call():
            if torch.compiler.is_compiling():
                # No context manager around a traced call: Keras's own
                # graph breaks inside it would force a recompile per layer.
                return _reduced(original(self, *args, **kwargs))
            record = islands.recorder()  # a run to check against
            if record is not None:
                key = record.enter(self, args, kwargs)
            with gathered_weights(self, distribution):
                outputs = _reduced(original(self, *args, **kwargs))
            if record is not None:
                record.leave(key, outputs)
            return outputs
        args, kwargs = distribute_batch((args, kwargs), distribution)

        def as_dtensors():
            with context.global_values(), gathered_weights(self, distribution):
                return _reduced(original(self, *args, **kwargs))

        local = local_run.plan(self, distribution)
        if local is not None:
            done, outputs = local_run.call(
                self, original, local, args, kwargs, as_dtensors
            )
            if done:
                return outputs
        return as_dtensors()

    return __call__
