"""Keras's torch `Variable` as a `Parameter` wrapping a laid-out DTensor."""

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor import model_parallel
from keras_dtensor import planning
from keras_dtensor import saving
from keras_dtensor.backend import context
from keras_dtensor.backend.distribution_lib import as_backend_layout
from keras_dtensor.backend.distribution_lib import check_layout
from keras_dtensor.backend.distribution_lib import distribute_tensor
from keras_dtensor.backend.errors import AssignedInCall
from keras_dtensor.backend.layout import local_slices
from keras_dtensor.backend.shards import from_local
from keras_dtensor.backend.shards import shard_global_tensor
from keras_dtensor.hooks import sharded_init

__all__ = [
    "wrap_convert_to_numpy",
    "wrap_direct_assign",
    "wrap_filter_empty_gradients",
    "wrap_initialize",
    "wrap_initialize_with_initializer",
]


def _variable_layout(variable):
    """The variable's `TensorLayout`, or `None` (a plain Parameter)."""
    distribution = context.current()
    if distribution is None or context.is_data_parallel(distribution):
        return None  # plain replicated Parameters (see data_parallel/)
    if variable._layout is None:
        variable._layout = planning.lora_layout(
            distribution, variable
        ) or distribution.get_variable_layout(variable)
    if context.active() is None and variable._layout is not None:
        check_layout(variable._layout, variable.shape, path=variable.path)
        return None
    return variable._layout


def _to_dtensor(variable, value):
    """Lays `value` (a global value or a DTensor) out as `variable`."""
    layout = as_backend_layout(
        variable._layout, path=variable.path, shape=variable.shape
    )
    if isinstance(value, DTensor):
        return distribute_tensor(value, layout)
    value = compat.torch_core().convert_to_tensor(value, dtype=variable._dtype)
    return shard_global_tensor(value, layout)


def wrap_initialize(original):
    """Wraps `Variable._initialize`: shard the initial value by layout."""

    def _initialize(self, value):
        model_parallel.variables_changed()
        self._shape = self._validate_shape(value.shape)
        if _variable_layout(self) is None:
            return original(self, value)
        if isinstance(value, torch.nn.Parameter):
            value = value.detach()
        laid_out = _to_dtensor(self, value)
        owned = from_local(  # its local shard owns its memory
            laid_out.to_local().clone(),
            laid_out.device_mesh,
            laid_out.placements,
            laid_out.shape,
            laid_out.stride(),
        )
        self._value = torch.nn.Parameter(owned, requires_grad=self.trainable)

    return _initialize


def wrap_initialize_with_initializer(original):
    """Wraps `Variable._initialize_with_initializer`: a shard drawn."""

    def _initialize_with_initializer(self, initializer):
        model_parallel.variables_changed()
        if _variable_layout(self) is None:
            return original(self, initializer)
        # An initializer's seed generator may be a (replicated) variable.
        with context.global_values():
            if not _initialize_shard_only(self, initializer):
                original(self, initializer)

    return _initialize_with_initializer


def _initialize_shard_only(variable, initializer):
    """Creates only this rank's shard; `False` where Keras's path runs."""
    backend = compat.torch_core()
    layout = as_backend_layout(
        variable._layout, path=variable.path, shape=variable._shape
    )
    mesh, placements = layout.device_mesh, layout.placements
    if (
        all(p.is_replicate() for p in placements)
        or not sharded_init.supports(initializer)
        or not sharded_init.chunked_draws_match(str(backend.get_device()))
    ):
        return False
    shape = tuple(variable._shape)
    ranges = local_slices(shape, mesh, placements)
    # An int seed (or none) starts the same stream at every call.
    seed = getattr(initializer, "seed", None)
    blockwise = seed is None or isinstance(seed, int)
    value = sharded_init.LocalDraws(shape, ranges).run(
        initializer, variable._dtype, blockwise
    )
    local_shape = tuple(n for _, n in ranges)
    if value is not None:
        value = backend.convert_to_tensor(value, dtype=variable._dtype)
    if value is None or tuple(value.shape) != local_shape:
        raise RuntimeError(
            f"keras-dtensor: sharded initialization of {variable.path!r} "
            f"(shape {shape}) with {type(initializer).__name__} produced "
            f"shape {None if value is None else tuple(value.shape)}, expected "
            f"this rank's shard {local_shape}. Please report this; as a "
            "workaround, pass the initial value as an array."
        )
    dtensor = from_local(value.contiguous(), mesh, placements, shape)
    variable._value = torch.nn.Parameter(
        dtensor, requires_grad=variable.trainable
    )
    return True


def wrap_direct_assign(original):
    """Wraps `Variable._direct_assign`: lay the value out, then copy."""

    def _direct_assign(self, value):
        if not isinstance(self._value, DTensor):
            if context.current() is None:
                # (Nothing here torch.compile cannot trace.)
                return original(self, value)
            if model_parallel.in_local_run():
                # A local value must not land in a global variable.
                raise AssignedInCall(self.path)
            if isinstance(value, DTensor):
                # Made outside the scope: it holds the global value.
                value = value.full_tensor()
            return original(self, value)
        if model_parallel.recording():
            # The run a local run is checked against writes nothing.
            raise AssignedInCall(self.path)
        with torch.no_grad():
            self._value.copy_(_to_dtensor(self, value))

    return _direct_assign


def wrap_convert_to_numpy(original):
    """Wraps `convert_to_numpy`: a DTensor gathered (a collective)."""

    def _convert_to_numpy(x):
        if isinstance(x, DTensor):
            if saving.deferring():
                return saving.Deferred(x)  # written in pieces
            x = x.full_tensor()
        elif isinstance(x, (list, tuple)) and any(
            isinstance(e, DTensor) for e in x
        ):
            x = type(x)(
                e.full_tensor() if isinstance(e, DTensor) else e for e in x
            )
        return original(x)

    return _convert_to_numpy


def _in_layout_of(grad, variable):
    """`grad` laid out as `variable`'s value."""
    value = getattr(variable, "value", None)
    if not isinstance(value, DTensor):
        return grad
    if isinstance(grad, DTensor):
        if grad.placements == value.placements:
            return grad
        return grad.redistribute(value.device_mesh, value.placements)
    return _to_dtensor(variable, grad)  # a plain tensor is a global value


def wrap_filter_empty_gradients(original):
    """Wraps `BaseOptimizer._filter_empty_gradients`: grads laid out."""

    def _filter_empty_gradients(self, grads, variables):
        grads, variables = original(self, grads, variables)
        distribution = context.active()
        if distribution is None or context.is_data_parallel(distribution):
            return grads, variables  # plain variables: nothing laid out
        grads = model_parallel.reduce_partial_grads(
            grads, [getattr(v, "value", None) for v in variables]
        )
        grads = [
            g if g is None else _in_layout_of(g, v)
            for g, v in zip(grads, variables, strict=True)
        ]
        return grads, variables

    return _filter_empty_gradients
