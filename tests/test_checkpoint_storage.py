"""DCP storage of sharded checkpoints, in one process.

The writer's digests are the files' SHA-256 (taken while writing, with
torch.save's CRC-32 off only meanwhile); the reader reads plain tensors
straight into the destination, anything else through DCP's reader, with
the same values as DCP, and refuses items DCP would unpickle freely.
"""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp


def _state():
    torch.manual_seed(0)
    return {
        "float": torch.randn(6, 5),
        "bfloat16": torch.randn(3, 4).to(torch.bfloat16),
        "bool": torch.rand(7) > 0.5,
        "scalar": torch.tensor(12, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(5, 6).t(),
        "view": torch.arange(40.0).reshape(8, 5)[2:5],
    }


def _zeros_like(state):
    return {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}


def test_digests_are_the_files_sha256_and_crc_option_is_restored(tmp_path):
    from keras_dtensor.checkpoint import manifest
    from keras_dtensor.checkpoint import writer

    writer = writer.DigestingWriter(tmp_path)
    dcp.save(_state(), storage_writer=writer)
    files = sorted(os.listdir(tmp_path))
    assert ".metadata" in files
    assert writer.digests == {
        name: manifest.hash_file(tmp_path / name) for name in files
    }
    assert torch.serialization.get_crc32_options()


def test_reads_equal_dcp_direct_where_plain(tmp_path, monkeypatch):
    from keras_dtensor.checkpoint import reader

    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path))
    direct = []
    read_direct = reader.SafeReader._read_direct

    def counting(self, f, item, planner, layouts):
        done = read_direct(self, f, item, planner, layouts)
        if done:
            direct.append(item.dest_index.fqn)
        return done

    monkeypatch.setattr(reader.SafeReader, "_read_direct", counting)
    mine, theirs = _zeros_like(state), _zeros_like(state)
    dcp.load(mine, storage_reader=reader.SafeReader(tmp_path))
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path))
    for key, value in state.items():
        assert torch.equal(mine[key], value), key
        assert torch.equal(theirs[key], value), key
    # A transposed tensor is saved with its strides: DCP's reader does it.
    assert sorted(direct) == sorted(set(state) - {"transposed", "empty"})


def test_byte_range_of_boxes():
    from keras_dtensor.checkpoint import reader as reader

    storage = reader._Storage(torch.float32, "0", 4 * 6 * 5)
    saved = reader._Saved(storage, 0, (4, 6, 5), (30, 5, 1), data_start=64)
    assert reader._byte_range(saved, [1, 0, 0], [2, 6, 5]) == (64 + 120, 240)
    assert reader._byte_range(saved, [2, 3, 0], [1, 2, 5]) == (64 + 300, 40)
    assert reader._byte_range(saved, [0, 0, 1], [4, 6, 2]) is None  # columns
    assert reader._byte_range(saved, [3, 0, 0], [2, 6, 5]) is None  # outside
    # Rows and a block of columns: not one run of bytes.
    assert reader._byte_range(saved, [0, 0, 0], [2, 3, 5]) is None
    assert reader._byte_range(saved, [0, 2, 0], [1, 3, 5]) == (64 + 40, 60)


def test_box_split_over_two_dims_reads_its_values(tmp_path):
    """A tensor saved whole, read back as the box one rank of a 2-D
    sharding holds (rows and columns cut): the box's values."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner import ReadItem

    from keras_dtensor.checkpoint import reader

    full = torch.arange(24.0).reshape(4, 6)
    dcp.save({"x": full}, storage_writer=dcp.FileSystemWriter(tmp_path))
    safe = reader.SafeReader(tmp_path)
    safe.set_up_storage_reader(safe.read_metadata(), is_coordinator=True)
    target = torch.zeros(2, 3)

    class Planner:
        def resolve_tensor(self, item):
            return target

        def commit_tensor(self, item, tensor):
            pass

    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("x", torch.Size([2, 3])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("x", torch.Size([0, 0])),
        storage_offsets=torch.Size([2, 3]),
        lengths=torch.Size([2, 3]),
    )
    safe.read_data(LoadPlan([item]), Planner()).wait()
    assert torch.equal(target, full[2:4, 3:6]), target


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_items_are_refused(tmp_path):
    from keras_dtensor.checkpoint import reader

    marker = tmp_path / "ran"
    payload = io.BytesIO(pickle.dumps(_Payload(str(marker))))
    dcp.save({"x": payload}, storage_writer=dcp.FileSystemWriter(tmp_path))
    with pytest.raises(BaseException, match="Refusing to unpickle"):
        dcp.load(
            {"x": torch.zeros(3)},
            storage_reader=reader.SafeReader(tmp_path),
        )
    assert not marker.exists()
