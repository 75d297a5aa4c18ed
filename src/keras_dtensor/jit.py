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

__all__ = ["should_torch_compile"]

_COMPILED = "_keras_dtensor_compiled_call"


def _compile_forward(model):
    if model.__dict__.get(_COMPILED):
        return
    # An instance attribute shadows the class's `call` for this model only.
    object.__setattr__(model, "call", torch.compile(model.call, dynamic=False))
    object.__setattr__(model, _COMPILED, True)


def should_torch_compile(original):
    """Wraps `TorchTrainer._should_torch_compile` (see module docstring)."""

    def _should_torch_compile(self):
        from keras.src.backend.common import global_state

        if not original(self):
            return False
        from keras_dtensor.data_parallel import is_local_mode

        distribution = global_state.get_global_attribute("distribution")
        if distribution is None or is_local_mode(distribution):
            return True  # plain tensors: Keras's own whole-step compile
        _compile_forward(self)
        return False

    return _should_torch_compile
