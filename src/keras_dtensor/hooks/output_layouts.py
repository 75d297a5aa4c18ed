"""Output layout lookups by path, remembered per distribution.

Under ModelParallel, Keras's `Layer.__call__` asks the distribution for a
layout of the layer's output on every call
(`get_tensor_layout(path + "/output")`, a `LayoutMap` lookup: the exact
key, then every key tried as a regular expression). Under JAX that runs
once per trace; in torch's eager steps it runs on every call of every
layer, a `re.fullmatch` per key. The answer depends only on the path and
the layout map's entries, so it is kept per distribution and path, and
forgotten as soon as the entries differ (a key added or removed, a value
replaced, another map). A path that several keys match is never kept: it
raises on every lookup, as Keras's does. Inside a compiled forward
(`jit_compile=True`) Keras's own lookup runs: dynamo traces it once, where
the memo's dict would be guarded and recompiled on.
"""

import functools

import torch

from keras_dtensor.backend import object_state

__all__ = ["wrap_get_tensor_layout"]

_MEMO = "_keras_dtensor_tensor_layouts"


def wrap_get_tensor_layout(original):
    """Wraps `ModelParallel.get_tensor_layout`: each path's answer kept."""

    @functools.wraps(original)
    def get_tensor_layout(self, path):
        if torch.compiler.is_compiling():
            return original(self, path)
        layout_map = self._layout_map
        # TensorLayout has no __eq__: the entries compare by identity.
        entries = tuple(layout_map._layout_map.items())
        memo = object_state.get_on(self, _MEMO)
        if memo is None or memo[0] is not layout_map or memo[1] != entries:
            memo = object_state.set_on(self, _MEMO, (layout_map, entries, {}))
        answers = memo[2]
        if path in answers:
            return answers[path]
        answers[path] = layout = original(self, path)
        return layout

    return get_tensor_layout
