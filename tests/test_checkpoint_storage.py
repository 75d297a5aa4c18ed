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
