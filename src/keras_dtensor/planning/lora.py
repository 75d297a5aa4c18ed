"""Layouts of LoRA factors, from their base weight's; nothing allocated."""

__all__ = ["lora_layout"]

# LoRA factor name -> (its base weight's name, which side it factors)
_LORA = {
    "lora_kernel_a": ("kernel", "a"),
    "lora_kernel_b": ("kernel", "b"),
    "lora_embeddings_a": ("embeddings", "a"),
    "lora_embeddings_b": ("embeddings", "b"),
}


def lora_layout(distribution, variable):
    """The layout of a LoRA factor no LayoutMap key names, or `None`.

    `A` keeps its base weight's input-dim axes and `B` its output-dim
    axis, so `A @ B` is sharded like the base (no communication).

    Example:
    >>> layout_map["dense/kernel"] = (None, "model")
    >>> lora.lora_layout(distribution, dense.lora_kernel_b).axes
    (None, 'model')
    """
    from keras.distribution import TensorLayout

    layout_map = getattr(distribution, "_layout_map", None)
    head, _, name = variable.path.rpartition("/")
    if layout_map is None or name not in _LORA:
        return None
    if layout_map[variable.path] is not None:
        return None  # named by the user: theirs wins
    base_name, side = _LORA[name]
    base = layout_map[f"{head}/{base_name}" if head else base_name]
    if base is None:
        return None
    ndim = len(variable.shape)
    if side == "a":
        axes = tuple(base.axes)[: ndim - 1] + (None,)
        axes = axes + (None,) * (ndim - len(axes))
    else:
        axes = (None, base.axes[-1] if base.axes else None)
    return TensorLayout(axes, layout_map.device_mesh)
