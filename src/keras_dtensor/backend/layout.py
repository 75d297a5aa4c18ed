"""Pure layout arithmetic: Keras axes (per tensor dim, mesh axes) to DTensor
placements (per mesh dim, what it does to the tensor), local shapes."""

import math

from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_dtensor.backend.errors import describe_mesh

__all__ = [
    "chunk",
    "contiguous_strides",
    "even_shards",
    "local_shape",
    "local_slices",
    "normalize_axes",
    "placed_shape",
    "to_placements",
]


def chunk(length, parts, index) -> tuple:
    """`(start, size)` of chunk `index` of `length` by `torch.chunk`'s rule."""
    step = math.ceil(length / parts) if length else 0
    start = min(index * step, length)
    return start, max(0, min(step, length - start))


def local_slices(shape, mesh, placements, coordinate=None) -> list:
    """`(start, length)` per dim of this rank's (`coordinate`'s) shard."""
    ranges = [(0, n) for n in shape]
    if coordinate is None:
        coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            start, length = ranges[placement.dim]
            offset, size = chunk(
                length, mesh.size(mesh_dim), coordinate[mesh_dim]
            )
            ranges[placement.dim] = (start + offset, size)
    return ranges


def placed_shape(shape, mesh, placements) -> tuple:
    """This rank's shape of a tensor of global `shape`."""
    return tuple(n for _, n in local_slices(shape, mesh, placements))


def even_shards(shape, mesh, placements, skip=None) -> bool:
    """Whether every rank's shard of `shape` has one shape (`skip` aside)."""
    parts = [1] * len(shape)
    for m, p in enumerate(placements):
        if p.is_shard() and m != skip:
            parts[p.dim] *= mesh.size(m)
    return all(n % k == 0 for n, k in zip(shape, parts, strict=True))


def local_shape(shape, axes, sizes) -> tuple:
    """The largest shard of `shape` split by normalized `axes` on `sizes`."""
    return tuple(
        chunk(n, math.prod(sizes[name] for name in names), 0)[1]
        for n, names in zip(shape, axes, strict=True)
    )


def contiguous_strides(shape) -> tuple:
    """Row-major strides of `shape` (a size-0 dim counts as 1, as in torch)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def normalize_axes(axes) -> tuple:
    """The axes with every entry a tuple of mesh-axis names."""
    return tuple(
        () if e is None else (e,) if isinstance(e, str) else tuple(e)
        for e in axes
    )


def to_placements(axes, mesh_shape, axis_names, *, path=None, shape=None):
    """Layout axes as one DTensor placement per mesh dimension; raises
    `ValueError` (naming `path` and `shape`) for an unknown or repeated
    axis, too many axes, or axes out of the mesh's order."""
    axis_names = tuple(axis_names)
    normalized = normalize_axes(axes)

    def fail(reason):
        what = f"`{path}`" if path else "tensor"
        if shape is not None:
            what += f" {tuple(shape)}"
        return ValueError(
            f"Cannot shard {what} with axes {tuple(axes)} on "
            f"{describe_mesh(mesh_shape, axis_names)}: {reason}."
        )

    if shape is not None and len(normalized) > len(shape):
        raise fail(
            f"the layout has {len(normalized)} axes but the tensor has "
            f"{len(shape)} dimensions"
        )
    placements = [Replicate()] * len(axis_names)
    used = set()
    for dim, names in enumerate(normalized):
        mesh_dims = []
        for name in names:
            if name not in axis_names:
                raise fail(f"axis {name!r} is not a mesh axis")
            if name in used:
                raise fail(f"mesh axis {name!r} is used more than once")
            used.add(name)
            mesh_dims.append(axis_names.index(name))
        if mesh_dims != sorted(mesh_dims):
            raise fail(
                f"dimension {dim} is sharded over {names}, which is not "
                "the mesh's axis order; list the axes major to minor in "
                "mesh order"
            )
        for mesh_dim in mesh_dims:
            placements[mesh_dim] = Shard(dim)
    return tuple(placements)
