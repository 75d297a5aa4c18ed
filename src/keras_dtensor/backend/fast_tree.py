"""Keras's `tree.flatten`, `pack_sequence_as` and `map_structure`, fast for
plain tuples, lists and dicts of tensors and scalars; else Keras's own."""

import torch

__all__ = ["flatten", "map_structure", "pack_sequence_as"]

_LEAVES = (torch.Tensor, int, float, str, type(None))
_SIMPLE = (tuple, list, dict)


def _simple(x):
    """Whether `x` is a structure this module walks."""
    kind = type(x)
    if kind is tuple or kind is list:
        return all(_simple(v) for v in x)
    if kind is dict:
        try:
            sorted(x)  # (needed only for the outermost dicts)
        except TypeError:
            return False
        return all(_simple(v) for v in x.values())
    return isinstance(x, _LEAVES) and not isinstance(x, _SIMPLE)


# [whether Keras sorts the keys of a dict inside a dict], once known.
_SORTS_NESTED = []


def _sorts_nested():
    if not _SORTS_NESTED:
        from keras.src import tree

        _SORTS_NESTED.append(tree.flatten({"a": {"b": 0, "a": 1}}) == [1, 0])
    return _SORTS_NESTED[0]


def _walk(x, leaf, top=True):
    """`x` rebuilt with `leaf(v)` for each leaf, in Keras's order."""
    kind = type(x)
    if kind is tuple or kind is list:
        return kind([_walk(v, leaf, top) for v in x])
    if kind is dict:
        keys = sorted(x) if top else list(x)
        nested = top and _sorts_nested()
        return {k: _walk(x[k], leaf, nested) for k in keys}
    return leaf(x)


def flatten(structure):
    """`keras.tree.flatten(structure)`."""
    if not _simple(structure):
        from keras.src import tree

        return tree.flatten(structure)
    out = []
    _walk(structure, out.append)
    return out


def pack_sequence_as(structure, flat):
    """`keras.tree.pack_sequence_as(structure, flat)`."""
    if not _simple(structure):
        from keras.src import tree

        return tree.pack_sequence_as(structure, flat)
    values = iter(flat)
    return _walk(structure, lambda _: next(values))


def map_structure(fn, structure):
    """`keras.tree.map_structure(fn, structure)` (one structure)."""
    if not _simple(structure):
        from keras.src import tree

        return tree.map_structure(fn, structure)
    return _walk(structure, fn, top=False)  # torch's tree_map: no sorting
