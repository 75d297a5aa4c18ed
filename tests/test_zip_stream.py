"""The `.keras` zip written in one pass: zip validity and Keras loading."""

import io
import os
import random
import zipfile
import zlib

import h5py
import numpy as np
import pytest

from keras_dtensor.saving import crc32
from keras_dtensor.saving import zip_writer


def _archive(path, directory, rows=300):
    """An archive with every kind of member; the window holds an h5."""
    asset = os.path.join(directory, "vocab.txt")
    with open(asset, "w") as f:
        f.write("a\nb\n")
    os.makedirs(os.path.join(directory, "empty"), exist_ok=True)
    values = np.arange(rows * 64, dtype="float32").reshape(rows, 64)
    with (
        open(path, "wb") as f,
        zip_writer.StoredZip(f) as archive,
    ):
        archive.writestr("metadata.json", b'{"keras_version": "3"}')
        archive.writestr("config.json", '{"n\u00e9": 1}'.encode())
        with archive.member("model.weights.h5") as window:
            h5 = h5py.File(window, "w")
            dataset = h5.create_group("vars").create_dataset(
                "0", shape=values.shape, dtype="float32"
            )
            for start in range(0, rows, 64):  # in pieces, as saves do
                dataset[start : start + 64] = values[start : start + 64]
            h5.close()
        archive.write(asset, "assets/vocab.txt")
        archive.write(os.path.join(directory, "empty"), "assets/empty")
        archive.writestr("\u00e9.json", b"")
    return values


def _check(path, values):
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every member's CRC-32
        names = [i.filename for i in z.infolist()]
        assert names == [
            "metadata.json",
            "config.json",
            "model.weights.h5",
            "assets/vocab.txt",
            "assets/empty/",
            "\u00e9.json",
        ]
        assert z.read("assets/vocab.txt") == b"a\nb\n"
        assert z.getinfo("assets/empty/").is_dir()
        with h5py.File(io.BytesIO(z.read("model.weights.h5")), "r") as h5:
            np.testing.assert_array_equal(h5["vars/0"][()], values)
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED


def test_members_are_stored_and_their_crcs_hold(tmp_path):
    path = str(tmp_path / "a.zip")
    values = _archive(path, str(tmp_path))
    _check(path, values)


def test_zip64_fields_where_sizes_offsets_and_counts_need_them(
    tmp_path, monkeypatch
):
    # The limits lowered: every offset and size past them, so every
    # ZIP64 field and the ZIP64 end record are written and read back.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 40)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 3)
    path = str(tmp_path / "a.zip")
    values = _archive(path, str(tmp_path))
    with open(path, "rb") as f:
        assert b"PK\x06\x06" in f.read()  # the ZIP64 end record
    _check(path, values)


def test_a_window_reads_back_and_truncates(tmp_path):
    with (
        open(tmp_path / "a.zip", "wb") as f,
        zip_writer.StoredZip(f) as archive,
    ):
        archive.writestr("first", b"xyz")
        with archive.member("m") as window:
            window.write(b"0123456789")
            window.seek(2)
            assert window.read(3) == b"234"
            window.seek(-2, os.SEEK_END)
            assert window.read() == b"89"
            window.truncate(4)
    with zipfile.ZipFile(tmp_path / "a.zip") as z:
        assert z.testzip() is None
        assert z.read("m") == b"0123"


def test_an_error_in_a_member_leaves_no_central_directory(tmp_path):
    with (
        pytest.raises(RuntimeError, match="boom"),
        open(tmp_path / "a.zip", "wb") as f,
        zip_writer.StoredZip(f) as archive,
        archive.member("m") as window,
    ):
        window.write(b"partial")
        raise RuntimeError("boom")
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(tmp_path / "a.zip")


def test_a_second_member_waits_for_the_open_one(tmp_path):
    with open(tmp_path / "a.zip", "wb") as f, zip_writer.StoredZip(f) as a:
        with a.member("m"):
            with pytest.raises(ValueError, match="'m' is still being"):
                a.writestr("n", b"")


def test_crc32_combine_joins_checksums():
    rng = random.Random(0)
    for _ in range(100):
        a = rng.randbytes(rng.randrange(300))
        b = rng.randbytes(rng.randrange(300))
        joined = crc32.combine(zlib.crc32(a), zlib.crc32(b), len(b))
        assert joined == zlib.crc32(a + b)
    zeros = bytes(5 << 20)  # a long second part: many squarings
    joined = crc32.combine(zlib.crc32(b"x"), zlib.crc32(zeros), len(zeros))
    assert joined == zlib.crc32(b"x" + zeros)
    with pytest.raises(ValueError, match="Received: -1"):
        crc32.combine(0, 0, -1)


@pytest.mark.parametrize("summed", [1, 16, 10_000])
def test_pieces_checksummed_as_written_survive_overwrites(
    tmp_path, monkeypatch, summed
):
    # Writes at random offsets, some over earlier ones, some truncations:
    # the member's CRC-32 (joined from pieces and bytes read back) holds.
    monkeypatch.setattr(zip_writer, "_SUMMED", summed)
    rng = random.Random(summed)
    for trial in range(20):
        expected = bytearray()
        path = tmp_path / f"{trial}.zip"
        with (
            open(path, "wb") as f,
            zip_writer.StoredZip(f) as archive,
            archive.member("m") as window,
        ):
            for _ in range(30):
                offset = rng.randrange(600)
                data = rng.randbytes(rng.randrange(300))
                window.seek(offset)
                window.write(data)
                expected.extend(bytes(max(0, offset - len(expected))))
                expected[offset : offset + len(data)] = data
                if rng.random() < 0.1:
                    size = rng.randrange(900)
                    window.truncate(size)
                    expected = expected[:size]
                    expected.extend(bytes(size - len(expected)))
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None, trial
            assert z.read("m") == bytes(expected), trial


def test_plain_keras_loads_the_archive_with_assets(tmp_path):
    import keras

    from keras_dtensor.saving import collective

    @keras.saving.register_keras_serializable("test_zip_stream")
    class Scaled(keras.layers.Layer):
        """Multiplies by a factor kept as an asset file."""

        factor = 3.0

        def call(self, x):
            return x * self.factor

        def save_assets(self, dir_path):
            with open(os.path.join(dir_path, "factor.txt"), "w") as f:
                f.write(str(self.factor))

        def load_assets(self, dir_path):
            with open(os.path.join(dir_path, "factor.txt")) as f:
                self.factor = float(f.read())

    inputs = keras.Input((3,))
    outputs = Scaled()(keras.layers.Dense(2)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    x = np.arange(6, dtype="float32").reshape(2, 3)
    model.fit(x, np.ones((2, 2)), verbose=0)
    model.layers[-1].factor = 5.0
    path = str(tmp_path / "m.keras")
    with open(path, "wb") as f:
        collective._save_archive(model, f)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assets = [n for n in z.namelist() if n.endswith("/factor.txt")]
        assert [z.read(n) for n in assets] == [b"5.0"], z.namelist()
    loaded = keras.saving.load_model(path)
    assert loaded.layers[-1].factor == 5.0
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    for got, want in zip(
        loaded.optimizer.variables, model.optimizer.variables, strict=True
    ):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(want)
        )
