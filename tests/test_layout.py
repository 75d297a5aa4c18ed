"""Layout translation without a process group: mapping and error texts."""

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_dtensor.backend.layout import chunk
from keras_dtensor.backend.layout import local_shape
from keras_dtensor.backend.layout import normalize_axes
from keras_dtensor.backend.layout import to_placements

MESH = ((2, 4), ("batch", "model"))


@pytest.mark.parametrize(
    "axes, expected",
    [
        ((None, "model"), (Replicate(), Shard(1))),
        (("model", None), (Replicate(), Shard(0))),
        (("batch", "model"), (Shard(0), Shard(1))),
        (("model", "batch"), (Shard(1), Shard(0))),
        ((None, None), (Replicate(), Replicate())),
        # Trailing dimensions may be left out, as in a PartitionSpec.
        (("batch",), (Shard(0), Replicate())),
        ((), (Replicate(), Replicate())),
        # One dimension over two axes, major to minor in mesh order.
        ((("batch", "model"), None), (Shard(0), Shard(0))),
        ((None, ["batch", "model"]), (Shard(1), Shard(1))),
    ],
)
def test_to_placements(axes, expected):
    assert to_placements(axes, *MESH) == expected


def test_normalize_axes():
    assert normalize_axes((None, "a", ("a", "b"), ["c"])) == (
        (),
        ("a",),
        ("a", "b"),
        ("c",),
    )


@pytest.mark.parametrize(
    "axes, shape, message",
    [
        (("data", None), (8, 8), "axis 'data' is not a mesh axis"),
        (
            ("model", "model"),
            (8, 8),
            "mesh axis 'model' is used more than once",
        ),
        (
            (("model", "model"),),
            (8,),
            "mesh axis 'model' is used more than once",
        ),
        (
            (None, None, "model"),
            (8, 8),
            "the layout has 3 axes but the tensor has 2 dimensions",
        ),
        (
            (("model", "batch"),),
            (8,),
            "dimension 0 is sharded over ('model', 'batch'), which is not "
            "the mesh's axis order",
        ),
    ],
)
def test_errors_name_path_shape_axes_and_mesh(axes, shape, message):
    with pytest.raises(ValueError) as info:
        to_placements(axes, *MESH, path="model/dense/kernel", shape=shape)
    text = str(info.value)
    assert text.startswith(
        f"Cannot shard `model/dense/kernel` {shape} with axes {axes} on "
        "mesh shape (2, 4), axis_names ('batch', 'model'): "
    )
    assert message in text


def test_error_without_path():
    with pytest.raises(ValueError, match=r"^Cannot shard tensor with axes"):
        to_placements(("x",), *MESH)


def test_torch_style_dotted_keys_match_keras_paths():
    import keras

    mesh = keras.distribution.DeviceMesh(
        (2,), ["model"], devices=["cpu:0", "cpu:1"]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["mlp.up.kernel"] = (None, "model")
    layout_map[".*dense.*bias"] = ("model",)
    assert layout_map["mlp/up/kernel"].axes == (None, "model")
    assert layout_map["mlp/dense_1/bias"].axes == ("model",)
    assert layout_map["mlp/up/bias"] is None


def test_output_layouts_are_keras_answers_while_the_map_changes(monkeypatch):
    import re

    import keras

    ModelParallel = keras.distribution.ModelParallel  # noqa: N806
    keras_own = ModelParallel.get_tensor_layout.__wrapped__
    mesh = keras.distribution.DeviceMesh(
        (2,), ["model"], devices=["cpu:0", "cpu:1"]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*output"] = (None, "model")
    distribution = ModelParallel(layout_map=layout_map)
    paths = ["mlp/dense/output", "mlp/up/output", "mlp/up/bias/output"]

    def check():
        for path in paths * 2:  # the second time from the memo
            ours = distribution.get_tensor_layout(path)
            assert ours is keras_own(distribution, path), path

    check()
    # A path asked again runs no regex: Layer.__call__ asks on every call.
    calls = []
    fullmatch = re.fullmatch
    monkeypatch.setattr(
        re, "fullmatch", lambda *a: calls.append(a) or fullmatch(*a)
    )
    distribution.get_tensor_layout("mlp/up/output")
    assert calls == []
    monkeypatch.undo()
    layout_map[".*bias.*"] = ("model",)  # a key added: the bias matches
    check()
    assert distribution.get_tensor_layout(paths[2]).axes == ("model",)
    del layout_map[".*bias.*"]
    check()
    assert distribution.get_tensor_layout(paths[2]) is None
    layout_map[".*bias.*"] = (None,)  # the same key again, another layout
    check()
    assert distribution.get_tensor_layout(paths[2]).axes == (None,)
    layout_map["mlp/.*"] = ("model",)  # now two keys match the dense
    for _ in range(2):
        with pytest.raises(ValueError, match="matches multiple"):
            distribution.get_tensor_layout("mlp/dense/output")


@pytest.mark.parametrize("length", [0, 1, 5, 7, 8, 9])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunk_is_torch_chunk(length, parts):
    # DTensor shards like torch.chunk; ranks past the chunks get nothing.
    pieces = torch.arange(length).chunk(parts) if length else ()
    for index in range(parts):
        start, size = chunk(length, parts, index)
        if index < len(pieces):
            assert (start, size) == (int(pieces[index][0]), len(pieces[index]))
        else:
            assert size == 0


def test_local_shape_is_the_first_chunk():
    sizes = {"batch": 2, "model": 3}
    axes = ((), ("model",), ("batch", "model"))
    assert local_shape((5, 7, 13), axes, sizes) == (5, 3, 3)
