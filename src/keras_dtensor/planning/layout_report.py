"""What `auto_layout` decided, as a table and a LayoutMap."""

import dataclasses
import math
import re

from keras_dtensor.backend.layout import local_shape
from keras_dtensor.backend.layout import normalize_axes
from keras_dtensor.planning.trace import keras_itemsize
from keras_dtensor.planning.trace import nbytes

__all__ = ["AutoLayout", "Entry", "finish"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One weight: its layout axes and why."""

    path: str
    shape: tuple
    axes: tuple
    why: str


@dataclasses.dataclass
class AutoLayout:
    """What `auto_layout` decided: entries, collectives and `layout_map`."""

    entries: list
    mesh: object
    model_axis: str
    batch_axis: str
    all_reduces_forward: int
    all_reduces_backward: int
    all_gathers_forward: int
    layout_map: object
    bytes_full: int
    bytes_per_rank: int

    def table(self) -> str:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape, strict=True))
        rows = [
            f"| {e.path} | {e.shape} | {e.axes} | {e.why} |"
            for e in self.entries
        ]
        lines = [
            f"auto layout over {self.model_axis!r} ({sizes[self.model_axis]} "
            f"ranks) of mesh {dict(sizes)}",
            "| weight | shape | axes | why |",
            "|---|---|---|---|",
            *rows,
            "collectives per training step (model axis): "
            f"{self.all_reduces_forward} all-reduces forward, "
            f"{self.all_reduces_backward} backward, "
            f"{self.all_gathers_forward} all-gathers forward",
            f"weights per rank: {self.bytes_per_rank / 2**20:.2f} MiB of "
            f"{self.bytes_full / 2**20:.2f} MiB",
        ]
        return "\n".join(lines)

    __str__ = table


def finish(
    model, mesh, model_axis, batch_axis, fsdp, decided, sizes, counts, min_bytes
):
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    entries, full, per_rank = [], 0, 0
    data = sizes.get(batch_axis, 1)
    for var in model.weights:
        dim, why = decided.get(var.path, (None, None))
        axes = [None] * len(var.shape)
        if dim is not None:
            axes[dim] = model_axis
        if fsdp and data > 1 and nbytes(var) >= max(min_bytes, 1):
            free = [d for d, a in enumerate(axes) if a is None]
            free = [d for d in free if var.shape[d] % data == 0]
            if free:
                d = max(free, key=lambda d: var.shape[d])
                axes[d] = batch_axis
                why = (why + "; " if why else "") + f"FSDP: dim {d} by batch"
        if why is None:
            why = (
                "replicated: not a projection's weight"
                if len(var.shape) < 2
                else "replicated: used by no projection the axis can split"
            )
        elif dim is None and "FSDP" not in why:
            why = "replicated, " + why
        local = local_shape(var.shape, normalize_axes(axes), sizes)
        full += nbytes(var)
        per_rank += math.prod(local) * keras_itemsize(var.dtype)
        if any(axes):
            layout_map["^" + re.escape(var.path) + "$"] = tuple(axes)
        entries.append(Entry(var.path, tuple(var.shape), tuple(axes), why))
    return AutoLayout(
        entries,
        mesh,
        model_axis,
        batch_axis,
        *counts,
        layout_map,
        full,
        per_rank,
    )
