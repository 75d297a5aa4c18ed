"""Message builders: every error names the tensor path, axes and the mesh."""

__all__ = ["describe_mesh", "layout_error"]


def describe_mesh(mesh_shape, axis_names) -> str:
    """Returns `mesh shape (2, 2), axis_names ('batch', 'model')`."""
    return f"mesh shape {tuple(mesh_shape)}, axis_names {tuple(axis_names)}"


def layout_error(
    reason, *, axes, mesh_shape, axis_names, path=None, shape=None
) -> ValueError:
    """Builds the `ValueError` raised for a layout that cannot be applied.

    Args:
        reason: what is wrong, in a few words.
        axes: the layout's axes, as given by the user.
        mesh_shape: shape of the device mesh.
        axis_names: axis names of the device mesh.
        path: the variable or tensor path, when known.
        shape: the tensor's global shape, when known.

    Returns:
        A `ValueError` to raise.

    Example:
    >>> str(layout_error("unknown axis 'x'", axes=("x",), mesh_shape=(2,),
    ...     axis_names=("model",), path="dense/kernel", shape=(4, 8)))
    "Cannot shard `dense/kernel` (4, 8) with axes ('x',) on mesh shape (2,), \
axis_names ('model',): unknown axis 'x'."
    """
    what = f"`{path}`" if path else "tensor"
    if shape is not None:
        what += f" {tuple(shape)}"
    return ValueError(
        f"Cannot shard {what} with axes {tuple(axes)} on "
        f"{describe_mesh(mesh_shape, axis_names)}: {reason}."
    )
