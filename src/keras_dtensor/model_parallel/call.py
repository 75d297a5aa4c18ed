"""The one entry of ModelParallel: a layer call under a layout.

`call_layer` runs every `Layer.__call__` under a distribution other than
`DataParallel`: locally where the model allows it (`local_run`), else on
DTensors. Outputs leave with partial sums reduced; their gradients are
laid out as the outputs where they enter the layer in backward. See
docs/internals/local-run.md.
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend.batch_layout import distribute_batch
from keras_dtensor.model_parallel import local_run
from keras_dtensor.model_parallel.boundary_layers import reduce_partial
from keras_dtensor.model_parallel.fsdp_blocks import gathered_weights
from keras_dtensor.model_parallel.local_run_spec import spec_for
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


def _laid_out(x):
    """`x` with partial sums reduced, its gradient laid out as `x`."""
    x = reduce_partial(x)
    if (
        isinstance(x, DTensor)
        and x.requires_grad
        and not torch.compiler.is_compiling()
    ):
        x.register_hook(functools.partial(_grad_in_layout, tuple(x.placements)))
    return x


def _reduced(outputs):
    """A layer's outputs with partial sums reduced."""
    fn = _laid_out if torch.is_grad_enabled() else reduce_partial
    return fast_tree.map_structure(fn, outputs)


def call_layer(layer, original, args, kwargs, distribution):
    """Runs `original(layer, *args, **kwargs)` (Keras's `Layer.__call__`)
    under `distribution`; returns DTensors with no partial sums, or plain
    tensors inside a local run."""
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

    local = spec_for(layer, distribution)
    if local is not None:
        done, outputs = local_run.call(
            layer, original, local, args, kwargs, as_dtensors
        )
        if done:
            return outputs
    return as_dtensors()
