"""The one entry of ModelParallel: a layer call under a layout.

`call_layer` runs every `Layer.__call__` under a distribution other than
`DataParallel`, in this order:

1. inside a local run (`local_run`): the layer runs on this rank's rows as
   plain tensors, or as a DTensor island (`boundary_layers`) when it is sharded;
2. a nested call: the layer runs on DTensors, its weights gathered where a
   layout shards them over the batch axis (`fsdp_weights`), its outputs'
   partial sums reduced at its boundary;
3. the outermost call: the global batch becomes batch-sharded DTensors
   (`model(x)` outside `fit` gets numpy or plain tensors), then the model
   runs locally when its layouts allow it (`local_run.plan`), else on
   DTensors in the global-values scope.

Gradients meet the same boundary in backward: a layer output's gradient
that arrives as a partial sum is reduced to the output's own layout there
(see `_reduce_partial_grad`).
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend.batch_layout import distribute_batch
from keras_dtensor.model_parallel import local_run
from keras_dtensor.model_parallel.boundary_layers import reduce_partial
from keras_dtensor.model_parallel.fsdp_weights import gathered_weights
from keras_dtensor.model_parallel.reference_run import recorder

__all__ = ["call_layer"]


def _in_layer_call():
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("current_call_ctx") is not None


def _grad_in_layout(placements, grad):
    """A gradient hook: partial sums reduced to the forward `placements`."""
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
    gradient comes back as a partial sum and travels on through the ops
    before it: an embedding's backward, a scatter into the whole table,
    then makes a table-sized partial sum on every rank, reduced only when
    the optimizer lays it out (model (a) of benchmarks/bench_memory.py
    held the full table twice per rank). torch's `ColwiseParallel` reduces it at
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
    """A layer's outputs with partial sums reduced (and, under autograd,
    their gradients laid out as the outputs when they arrive)."""
    if torch.is_grad_enabled():
        return fast_tree.map_structure(
            lambda x: _reduce_partial_grad(reduce_partial(x)), outputs
        )
    return fast_tree.map_structure(reduce_partial, outputs)


def call_layer(layer, original, args, kwargs, distribution):
    """Runs `original(layer, *args, **kwargs)` under `distribution`.

    Args:
        layer: the Keras layer being called.
        original: Keras's `Layer.__call__`.
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        distribution: the active distribution (not `DataParallel`).

    Returns:
        The layer's outputs: DTensors with no partial sums, or plain
        tensors inside a local run.
    """
    if not torch.compiler.is_compiling() and local_run.active():
        return local_run.inner_call(layer, original, args, kwargs)
    if _in_layer_call():
        if torch.compiler.is_compiling():
            # No context manager around a traced call: Keras's own
            # graph breaks inside it would force a recompile per layer.
            return _reduced(original(layer, *args, **kwargs))
        record = recorder()  # a run to check against
        if record is not None:
            key = record.enter(layer, args, kwargs)
        with gathered_weights(layer, distribution):
            outputs = _reduced(original(layer, *args, **kwargs))
        if record is not None:
            record.leave(key, outputs)
        return outputs
    args, kwargs = distribute_batch((args, kwargs), distribution)

    def as_dtensors():
        with context.global_values(), gathered_weights(layer, distribution):
            return _reduced(original(layer, *args, **kwargs))

    local = local_run.spec_for(layer, distribution)
    if local is not None:
        done, outputs = local_run.call(
            layer, original, local, args, kwargs, as_dtensors
        )
        if done:
            return outputs
    return as_dtensors()
