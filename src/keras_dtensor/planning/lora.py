"""Layouts of LoRA factors, from their base weight's; nothing allocated."""

import re

__all__ = ["lora_layout"]


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
    factor = re.fullmatch(r"lora_(kernel|embeddings)_([ab])", name)
    if layout_map is None or factor is None:
        return None
    if layout_map[variable.path] is not None:
        return None  # named by the user: theirs wins
    base_name, side = factor.groups()
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
