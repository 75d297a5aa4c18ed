"""Checks of a LayoutMap against a model; nothing allocated or sent."""

import re
import warnings

from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import world

__all__ = ["unmatched_keys", "warn_unmatched_layout_keys"]

_WARNED = "_keras_dtensor_warned_keys"


def unmatched_keys(layout_map, paths):
    """The LayoutMap keys but `.../output` that full-match no path."""
    return [
        key
        for key in layout_map
        if not key.endswith("/output")
        and not any(key == p or re.fullmatch(key, p) for p in paths)
    ]


def warn_unmatched_layout_keys(model, distribution):
    """Warns (rank 0, once per key) of LayoutMap keys no weight matched."""
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None or world()[1] != 0:
        return
    warned = object_state.get_on(distribution, _WARNED)
    if warned is None:
        warned = object_state.set_on(distribution, _WARNED, set())
    paths = [v.path for v in model.weights]
    for key in unmatched_keys(layout_map, paths):
        if key not in warned:
            warned.add(key)
            example = paths[0] if paths else "<none>"
            warnings.warn(
                f"LayoutMap key {key!r} matches none of the weights of "
                f"model {model.name!r}; the weights it was meant for stay "
                "replicated. Keys are regular expressions matched against "
                f"the whole `variable.path` (e.g. {example!r}); prefix '.*' "
                "to match any parent path.",
                stacklevel=2,
            )
