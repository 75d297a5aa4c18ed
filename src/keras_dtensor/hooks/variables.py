"""Hook bodies for Keras's torch `Variable`: values are DTensors by layout.

A variable created while a distribution is active takes its layout from
the distribution (`Distribution.get_variable_layout`, as on JAX) and keeps
its value as a `torch.nn.Parameter` wrapping a `DTensor`. Assignments are
laid out the same way before the in-place copy. `keras_dtensor.patches` installs
these; each receives the original method it replaces.
"""

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
from keras_dtensor.backend.shards import shard_global_tensor
from keras_dtensor.hooks import sharded_init

__all__ = [
    "variable_layout",
    "wrap_convert_to_numpy",
    "wrap_direct_assign",
    "wrap_filter_empty_gradients",
    "wrap_initialize",
    "wrap_initialize_with_initializer",
]


def variable_layout(variable):
    """The variable's `TensorLayout`, resolved from the distribution once.

    Args:
        variable: a Keras torch `Variable` whose shape is known.

    Returns:
        The `TensorLayout`, or `None` outside any distribution, under
        `DataParallel` and in a job of one process (plain Parameters; the
        layout is still checked against the variable, so a layout error
        shows at one process as it would at N).
    """
    distribution = context.current()
    if distribution is None or context.is_data_parallel(distribution):
        return None  # plain replicated Parameters (see data_parallel/)
    if variable._layout is None:
        variable._layout = planning.lora_layout(
            distribution, variable
        ) or distribution.get_variable_layout(variable)
    if context.active() is None and variable._layout is not None:
        # The error a job of N processes would raise for this layout.
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
    convert_to_tensor = compat.torch_core().convert_to_tensor

    value = convert_to_tensor(value, dtype=variable._dtype)
    return shard_global_tensor(value, layout)


def _owned(dtensor):
    """A DTensor whose local shard owns its memory (not a view of the
    full value, which would keep the full value alive)."""
    return DTensor.from_local(
        dtensor.to_local().clone(),
        dtensor.device_mesh,
        dtensor.placements,
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    )


def wrap_initialize(original):
    """Wraps `Variable._initialize`: shard the initial value by layout."""

    def _initialize(self, value):
        model_parallel.variables_changed()
        self._shape = self._validate_shape(value.shape)
        if variable_layout(self) is None:
            return original(self, value)
        if isinstance(value, torch.nn.Parameter):
            value = value.detach()
        self._value = torch.nn.Parameter(
            _owned(_to_dtensor(self, value)), requires_grad=self.trainable
        )

    return _initialize


def wrap_initialize_with_initializer(original):
    """Wraps `Variable._initialize_with_initializer`.

    The layout is resolved before the initializer runs, so the process
    group and the agreed random seed exist when the initial value is drawn.
    """

    def _initialize_with_initializer(self, initializer):
        model_parallel.variables_changed()
        if variable_layout(self) is None:
            return original(self, initializer)
        # An initializer's seed generator may be a (replicated) variable.
        with context.global_values():
            if not _initialize_shard_only(self, initializer):
                original(self, initializer)

    return _initialize_with_initializer


def _initialize_shard_only(variable, initializer):
    """Creates only this rank's shard of `variable` (see sharded_init.py).

    Returns:
        Whether it did; `False` leaves the variable to Keras's own path
        (the full value is drawn, then sliced).
    """
    convert_to_tensor = compat.torch_core().convert_to_tensor
    get_device = compat.torch_core().get_device

    layout = as_backend_layout(
        variable._layout, path=variable.path, shape=variable._shape
    )
    mesh, placements = layout.device_mesh, layout.placements
    if all(p.is_replicate() for p in placements):
        return False
    if not sharded_init.supports(initializer):
        return False
    if not sharded_init.chunked_draws_match(str(get_device())):
        return False
    shape = tuple(variable._shape)
    ranges = local_slices(shape, mesh, placements)
    # An int seed (or none: Zeros, Ones, Constant) starts the same stream
    # on every call, so the initializer can run once per block of rows; a
    # SeedGenerator advances per call, so it runs once.
    seed = getattr(initializer, "seed", None)
    blockwise = seed is None or isinstance(seed, int)
    value = sharded_init.LocalDraws(shape, ranges).run(
        initializer, variable._dtype, blockwise
    )
    local_shape = tuple(n for _, n in ranges)
    if value is not None:
        value = convert_to_tensor(value, dtype=variable._dtype)
    if value is None or tuple(value.shape) != local_shape:
        raise RuntimeError(
            f"keras-dtensor: sharded initialization of {variable.path!r} "
            f"(shape {shape}) with {type(initializer).__name__} produced "
            f"shape {None if value is None else tuple(value.shape)}, expected "
            f"this rank's shard "
            f"{local_shape}. Please report this; as a workaround, pass the "
            "initial value as an array."
        )
    dtensor = DTensor.from_local(
        value.contiguous(),
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
    variable._value = torch.nn.Parameter(
        dtensor, requires_grad=variable.trainable
    )
    return True


def wrap_direct_assign(original):
    """Wraps `Variable._direct_assign`: lay the value out, then copy."""

    def _direct_assign(self, value):
        if not isinstance(self._value, DTensor):
            if context.current() is None:
                # Nothing distributed: Keras's own assign, and nothing here
                # that torch.compile cannot trace (optimizer and metric
                # updates run inside a compiled step).
                return original(self, value)
            if model_parallel.in_local_run():
                # A model on local rows: this rank's value must not land
                # in a global variable; the call reruns as DTensors.
                raise AssignedInCall(self.path)
            if isinstance(value, DTensor):
                # A variable made before the distribution (a metric built
                # outside its scope) holds the global value, as on JAX.
                value = value.full_tensor()
            return original(self, value)
        if model_parallel.recording():
            # The DTensor run a local run is checked against: it runs
            # again for real if needed; nothing may be written twice.
            raise AssignedInCall(self.path)
        with torch.no_grad():
            self._value.copy_(_to_dtensor(self, value))

    return _direct_assign


def wrap_convert_to_numpy(original):
    """Wraps `convert_to_numpy`: a DTensor is gathered to its global value.

    Every rank must convert the same DTensors in the same order (the
    gather is a collective); Keras's save, `get_weights` and `predict` do.
    """

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
    """`grad` laid out as `variable`'s value (the same object if it is)."""
    value = getattr(variable, "value", None)
    if not isinstance(value, DTensor):
        return grad
    if isinstance(grad, DTensor):
        if grad.placements == value.placements:
            return grad
        return grad.redistribute(value.device_mesh, value.placements)
    return _to_dtensor(variable, grad)  # a plain tensor is a global value


def wrap_filter_empty_gradients(original):
    """Wraps `BaseOptimizer._filter_empty_gradients(grads, variables)`.

    The first thing `optimizer.apply` does with the pairs. Backward leaves
    a gradient in whatever placement the last op's strategy produced: a
    partial sum, or sharded along another dim (a layout that shards a
    dimension smaller than the mesh axis, as `Dense(1)` under
    `(None, "model")`). The optimizer's in-place updates then fail ("in-place
    operations that require placement changes"). Each gradient is laid out
    as its variable here, once, for every optimizer.
    """

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
