"""Checks of a layout plan against a model, before anything is sharded.

Nothing here allocates or communicates.
"""

import re
import warnings

from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import world

__all__ = ["lora_layout", "warn_unmatched_layout_keys"]

_WARNED = "_keras_dtensor_warned_keys"
# LoRA factor name -> (its base weight's name, which side it factors)
_LORA = {
    "lora_kernel_a": ("kernel", "a"),
    "lora_kernel_b": ("kernel", "b"),
    "lora_embeddings_a": ("embeddings", "a"),
    "lora_embeddings_b": ("embeddings", "b"),
}


def lora_layout(distribution, variable):
    """The layout of a LoRA factor that no LayoutMap key names.

    Keras's `enable_lora` adds `A` (the base weight's input dims, rank)
    and `B` (rank, its output dim) next to a base `kernel`/`embeddings`.
    Laid out like their base weight, `A` keeps the base's input-dim axes
    and `B` its output-dim axis, so `A @ B` is sharded exactly like the
    base weight and adding it needs no communication.

    Args:
        distribution: the active distribution.
        variable: a Keras variable, shape known.

    Returns:
        A `TensorLayout`, or `None` (not a LoRA factor, a key names it, or
        its base weight has no layout of its own).

    Example:
    >>> layout_map["dense/kernel"] = (None, "model")
    >>> layout_plan.lora_layout(distribution, dense.lora_kernel_b).axes
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


def warn_unmatched_layout_keys(model, distribution):
    """Warns (rank 0, once per key) about LayoutMap keys no weight matched.

    A key is a regex full-matched against `variable.path`, so
    `"dense.*kernel"` does not match `"sequential/dense/kernel"`; the weight
    then silently stays replicated. Keys ending in `/output` name layer
    outputs, not weights, and are skipped.
    """
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None or world()[1] != 0:
        return
    warned = object_state.get_on(distribution, _WARNED)
    if warned is None:
        warned = object_state.set_on(distribution, _WARNED, set())
    paths = [v.path for v in model.weights]
    for key in layout_map:
        if key in warned or key.endswith("/output"):
            continue
        if not any(key == p or re.fullmatch(key, p) for p in paths):
            warned.add(key)
            example = paths[0] if paths else "<none>"
            warnings.warn(
                f"LayoutMap key {key!r} matches none of the weights of "
                f"model {model.name!r}; the weights it was meant for stay "
                "replicated. Keys are "
                "regular expressions matched against the whole "
                f"`variable.path` (e.g. {example!r}); prefix '.*' to match "
                "any parent path.",
                stacklevel=2,
            )
