"""`keras_dtensor.plan`: per-rank memory of a layout, before allocating.

Built on torch's `meta` device; each weight's layout comes from the
distribution, its largest shard (`torch.chunk`'s rule) gives the bytes
per rank. The same pass lints the layouts (docs/internals/planning.md).
"""

import dataclasses
import math

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend.layout import local_shape
from keras_dtensor.backend.layout import normalize_axes
from keras_dtensor.planning import lora
from keras_dtensor.planning.lint import unmatched_keys
from keras_dtensor.planning.trace import build_on
from keras_dtensor.planning.trace import keras_itemsize

__all__ = ["MemoryPlan", "VariablePlan", "plan"]

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class VariablePlan:
    """One weight: its layout and what it costs each rank."""

    path: str
    shape: tuple
    dtype: str
    axes: tuple
    local_shape: tuple
    bytes_per_rank: int
    slot_bytes_per_rank: int
    trainable: bool


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Weights, optimizer slots and totals per rank, and lint warnings."""

    variables: tuple
    mesh_shape: tuple
    axis_names: tuple
    warnings: tuple

    @property
    def weight_bytes_per_rank(self) -> int:
        return sum(v.bytes_per_rank for v in self.variables)

    @property
    def slot_bytes_per_rank(self) -> int:
        return sum(v.slot_bytes_per_rank for v in self.variables)

    @property
    def total_bytes_per_rank(self) -> int:
        return self.weight_bytes_per_rank + self.slot_bytes_per_rank

    def table(self) -> str:
        rows = [
            f"| {v.path} | {v.shape} | {v.axes} | {v.local_shape} | "
            f"{v.bytes_per_rank / _MIB:.2f} | "
            f"{v.slot_bytes_per_rank / _MIB:.2f} |"
            for v in self.variables
        ]
        lines = [
            f"mesh shape {self.mesh_shape}, axis_names {self.axis_names}",
            "| weight | shape | axes | local shape | MiB/rank | slots MiB |",
            "|---|---|---|---|---|---|",
            *rows,
            f"| total | | | | {self.weight_bytes_per_rank / _MIB:.2f} | "
            f"{self.slot_bytes_per_rank / _MIB:.2f} |",
            f"weights + optimizer slots per rank: "
            f"{self.total_bytes_per_rank / _MIB:.2f} MiB",
            *(f"warning: {w}" for w in self.warnings),
        ]
        return "\n".join(lines)

    __str__ = table


def plan(
    model_or_build_fn,
    distribution,
    optimizer=None,
    large_replicated_mib=16.0,
):
    """Per-rank memory of `distribution`'s layouts, before allocating.

    Args:
        model_or_build_fn: a function that builds the Keras model (run on
            torch's `meta` device), or a built model.
        distribution: the `ModelParallel` or `DataParallel` to plan for;
            its mesh may name more devices than this machine has.
        optimizer: an optimizer (instance or name, e.g. `"adamw"`) whose
            slots follow their variable's layout; `None` for weights only.
        large_replicated_mib: warn about replicated weights above this size.

    Returns:
        A `MemoryPlan`; `print(plan)` shows the table.

    Example:
    >>> mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    >>> layout_map = keras.distribution.LayoutMap(mesh)
    >>> layout_map[".*kernel"] = (None, "model")
    >>> print(keras_dtensor.plan(build_model,
    ...     keras.distribution.ModelParallel(layout_map=layout_map), "adamw"))
    """
    import keras

    previous = context.current()
    keras.distribution.set_distribution(None)  # plain, shape-only weights
    try:
        model, slots = build_on(model_or_build_fn, "meta"), []
        if optimizer is not None:
            with compat.torch_core().device_scope("meta"):
                optimizer = keras.optimizers.get(optimizer)
                optimizer.build(model.trainable_variables)
            slots = list(optimizer.variables)
    finally:
        keras.distribution.set_distribution(previous)
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    rows, warnings = [], []
    for variable in model.weights:
        layout = None
        if not context.is_data_parallel(distribution):
            layout = lora.lora_layout(
                distribution, variable
            ) or distribution.get_variable_layout(variable)
        shape = tuple(variable.shape)
        raw = layout.axes if layout is not None else (None,) * len(shape)
        axes = normalize_axes(raw)
        local = local_shape(shape, axes, sizes)
        own = math.prod(local) * keras_itemsize(variable.dtype)
        prefix = variable.path.replace("/", "_") + "_"
        slot_bytes = sum(
            math.prod(local) * keras_itemsize(s.dtype)
            for s in slots
            if s.name.startswith(prefix) and tuple(s.shape) == shape
        )
        rows.append(
            VariablePlan(
                path=variable.path,
                shape=shape,
                dtype=variable.dtype,
                axes=tuple(layout.axes) if layout is not None else (),
                local_shape=local,
                bytes_per_rank=own,
                slot_bytes_per_rank=slot_bytes,
                trainable=variable.trainable,
            )
        )
        for n, names in zip(shape, axes, strict=True):
            parts = math.prod(sizes[name] for name in names)
            if parts > 1 and n % parts:
                warnings.append(
                    f"{variable.path} {shape}: dim of {n} over {parts} "
                    "shards is uneven (torch.chunk: the last shards are "
                    "smaller or empty)"
                )
        if local == shape and own / _MIB > large_replicated_mib:
            warnings.append(
                f"{variable.path} {shape}: {own / _MIB:.1f} MiB replicated "
                "on every rank"
            )
    layout_map = getattr(distribution, "_layout_map", None) or {}
    paths = [v.path for v in model.weights]
    for key in unmatched_keys(layout_map, paths):
        warnings.append(f"LayoutMap key {key!r} matches no weight")
    return MemoryPlan(
        tuple(rows), tuple(mesh.shape), tuple(mesh.axis_names), tuple(warnings)
    )
