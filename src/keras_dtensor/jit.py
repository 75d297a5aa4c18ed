"""`jit_compile=True` under a distribution: compile the forward pass.

Keras's torch trainer compiles the whole `train_step`, which breaks the
graph at `loss.backward()`. With DTensor weights the first graph returns
several outputs that require grad (the loss and what the metrics use
later) and only the loss gets a gradient; AOTAutograd then meets a plain
zero tangent where it guessed a DTensor ("Expected a DTensor tangent but
got a plain Tensor"). Dynamic shapes also fail in
`DTensor.__tensor_unflatten__`.

So under a distribution the step runs eagerly around a compiled model
forward (`torch.compile(model.call, dynamic=False)`): the graph has one
differentiable output, its tangent is the DTensor gradient of the loss,
and each batch shape compiles once. Loss, backward, optimizer and metrics
run eagerly on DTensors.
"""

import torch

from keras_dtensor import context
from keras_dtensor import instance_patches

__all__ = ["wrap_should_torch_compile"]


def _compile_forward(model):
    if instance_patches.get_on(model, "call") is not None:
        return
    # An instance attribute shadows the class's `call` for this model only
    # (`uninstall()` removes it).
    instance_patches.set_on(
        model, "call", torch.compile(model.call, dynamic=False)
    )


def wrap_should_torch_compile(original):
    """Wraps `TorchTrainer._should_torch_compile` (see module docstring)."""

    def _should_torch_compile(self):
        if not original(self):
            return False
        distribution = context.active()
        if distribution is None or context.is_data_parallel(distribution):
            return True  # plain tensors: Keras's own whole-step compile
        _compile_forward(self)
        return False

    return _should_torch_compile
