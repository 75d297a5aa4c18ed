"""Output layouts looked up once per path until the layout map changes."""

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
        if path not in answers:
            answers[path] = original(self, path)
        return answers[path]

    return get_tensor_layout
