"""The package's fast walk of a call's arguments agrees with Keras's tree
functions: the same leaves in the same order (the exactness check pairs a
local run's inputs with a DTensor run's by position), the same rebuilt
structures, the same order of calls."""

import collections
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import pytest  # noqa: E402
import torch  # noqa: E402
from keras.src import tree  # noqa: E402

from keras_dtensor.backend import fast_tree  # noqa: E402

T, U = torch.ones(1), torch.zeros(2)
CASES = [
    T,
    (T,),
    ((T, None, 3), {"b": None, "a": T, "c": "x"}),  # a layer call's
    (T, {"training": False, "mask": None}),
    [T, (T, 2.0)],
    # Keras sorts the keys of the outermost dicts only.
    {"x": [T, {"z": 1, "y": U}]},
    [{"z": T, "a": U}, ({"q": 1, "b": {"y": 2, "c": 3}},)],
    {"b": {"z": 1, "a": 2}, "a": [{"z": 3, "a": 4}]},
    ((), {}),
    # Not walked here: Keras's own walk.
    (collections.OrderedDict(a=T), {}),
    (collections.namedtuple("P", "x y")(T, U), {}),
    ({"a": torch.ones(3).numpy()},),
]


@pytest.mark.parametrize("case", CASES)
def test_same_as_keras_tree(case):
    flat = tree.flatten(case)
    got = fast_tree.flatten(case)
    assert len(got) == len(flat)
    assert all(a is b for a, b in zip(got, flat, strict=True))
    numbers = list(range(len(flat)))
    assert repr(fast_tree.pack_sequence_as(case, numbers)) == repr(
        tree.pack_sequence_as(case, numbers)
    )
    assert repr(fast_tree.map_structure(id, case)) == repr(
        tree.map_structure(id, case)
    )
    seen_here, seen_keras = [], []
    fast_tree.map_structure(lambda x: seen_here.append(id(x)), case)
    tree.map_structure(lambda x: seen_keras.append(id(x)), case)
    assert seen_here == seen_keras
