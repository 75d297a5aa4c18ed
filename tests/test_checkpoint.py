"""Saving and loading under a distribution.

Files written by N ranks are ordinary Keras files: they load on a different
number of ranks, and in plain single-process Keras (this test process).
"""

import os

import keras
import numpy as np
import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _distribution(keras, world):
    import models

    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    return keras.distribution.ModelParallel(
        layout_map=models.layout_map(keras, mesh, models.TP_LAYOUTS["mlp"])
    )


# A table large enough that a whole copy of it on a rank stands out from
# the process's own noise: 32 MiB of float32.
TABLE = (65_536, 128)
TABLE_MB = TABLE[0] * TABLE[1] * 4 / 2**20


def _table_model(keras):
    """A sharded table and a bfloat16 head (Keras stores bfloat16 apart)."""
    tokens = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(*TABLE, name="table")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(7, dtype="bfloat16", name="head")(h)
    model = keras.Model(tokens, outputs)
    model.compile(optimizer="adam", loss="mse")
    return model


def _variables(model):
    return [*model.weights, *model.optimizer.variables]


def _checksum(array):
    import zlib

    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _shard_checksums(model):
    """This rank's `(ranges, crc32)` of every weight and optimizer
    variable: what it holds, without gathering anything."""
    from keras_dtensor.backend.layout import local_slices

    out = []
    for variable in _variables(model):
        value = variable.value
        ranges = local_slices(value.shape, value.device_mesh, value.placements)
        local = value.to_local().detach().reshape(-1).view(torch.uint8)
        out.append((ranges, _checksum(local.numpy())))
    return out


def _peak_mb(run):
    """This rank's resident high-water mark during `run()` over its
    resident memory before it, in MiB (Linux `/proc/self/status`)."""
    import gc

    def status_mb(field):
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    gc.collect()
    before = status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    run()
    return status_mb("VmHWM") - before


def _full_disk_save(save, path, limit_bytes):
    """`save(path)` whose writes on rank 0 fail past `limit_bytes` (as on a
    full disk): the error every rank raises, and how long it took."""
    import resource
    import signal
    import time

    import torch.distributed as dist

    from keras_dtensor.backend import launch

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    joins = launch.every_rank_joins

    def join_then_fill(*args):
        # The ranks meet in the rendezvous store first: a file store here,
        # which a process-wide file size limit would break too (a job's
        # store is not on the disk it saves to: TCP under torchrun).
        joins(*args)
        if dist.get_rank() == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit[1]))

    launch.every_rank_joins = join_then_fill
    start = time.monotonic()
    try:
        save(path)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        launch.every_rank_joins = joins
        if dist.get_rank() == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    return error, time.monotonic() - start


def _streamed_saves(directory):
    """Saves of the table on a 2 x 2 mesh (two replicas of each shard)."""
    import keras

    from keras_dtensor.saving import h5_stream

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*table/embeddings"] = (None, "model")
    layout_map[".*head/kernel"] = ("model", None)
    layout_map[".*head/bias"] = ("model",)  # 7 over 2: uneven
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        model = _table_model(keras)
        # One Adam step (the weights as gradients): slots that are not 0.
        model.optimizer.apply_gradients(
            [(v.value, v) for v in model.trainable_variables]
        )
        os.environ["KERAS_DTENSOR_SAVE_PIECE_MB"] = "1"
        out = {
            "peak_save_weights": _peak_mb(
                lambda: model.save_weights(
                    os.path.join(directory, "table.weights.h5")
                )
            ),
            "peak_save": _peak_mb(
                lambda: model.save(os.path.join(directory, "table.keras"))
            ),
            # Keras's sharded format: a file per 40 MB (a variable each).
            "peak_save_sharded": _peak_mb(
                lambda: model.save_weights(
                    os.path.join(directory, "table.weights.json"),
                    max_shard_size=0.04,
                )
            ),
        }
        table = model.get_layer("table").embeddings.value
        out["owners"] = h5_stream.shard_owners(
            table.shape, table.device_mesh, table.placements
        )
        # Mid-variable; and in model.save's config, before any weight.
        out["full_disk"] = _full_disk_save(
            model.save_weights,
            os.path.join(directory, "full_disk.weights.h5"),
            8 << 20,
        )
        out["full_disk_config"] = _full_disk_save(
            model.save, os.path.join(directory, "full_disk.keras"), 256
        )
        out["checksums"] = _shard_checksums(model)
    return out


def _write_kernels(model, path):
    """A weights file written by hand, as keras_hub's `save_lora_weights`
    writes its own: a Keras store opened outside `save_weights`."""
    from keras.src.saving import saving_lib

    store = saving_lib.H5IOStore(path, mode="w")
    for layer in model.layers:
        if getattr(layer, "kernel", None) is not None:
            store.make(layer.name)["kernel"] = layer.kernel
    store.close()


def _read_kernels(path):
    import h5py

    with h5py.File(path, "r") as f:
        return {name: np.asarray(f[name]["vars"]["kernel"]) for name in f}


def _save(directory):
    import keras
    import models

    world = keras.distribution.get_device_count()
    distribution = _distribution(keras, world)
    model, result = models.train(keras, "mlp", "adam", distribution)
    import torch.distributed as dist

    if dist.get_rank() == 0:  # what a save killed mid-write leaves behind
        leftover = os.path.join(directory, f".{'0' * 32}.mlp.weights.h5")
        open(leftover, "wb").close()
        staging = os.path.join(directory, f".{'1' * 32}.mlp.keras.d")
        os.mkdir(staging)
        open(os.path.join(staging, "mlp.keras"), "wb").close()
        os.mkdir(os.path.join(directory, f".{'2' * 32}.mlp.keras.partial"))
    with distribution.scope():
        model.save_weights(os.path.join(directory, "mlp.weights.h5"))
        model.save(os.path.join(directory, "mlp.keras"))
        _write_kernels(model, os.path.join(directory, "kernels.h5"))
    return {
        "predict": result["predict"],
        "weights": result["weights"],
        **_streamed_saves(directory),
        "files": sorted(os.listdir(directory)),
    }


def _load(directory):
    import time

    import keras
    import models
    import torch
    from torch.distributed.tensor import DTensor

    world = keras.distribution.get_device_count()
    distribution = _distribution(keras, world)
    x, _ = models.data("mlp")
    out = {}
    # A file rank 0 cannot write: the same error on every rank, at once
    # (not after the collective timeout).
    with distribution.scope():
        model = models.mlp(keras)
        start = time.monotonic()
        try:
            model.save(os.path.join(directory, "missing", "mlp.keras"))
            out["failed_save"] = None
        except RuntimeError as e:
            out["failed_save"] = str(e)
        out["failed_save_s"] = time.monotonic() - start
    with distribution.scope():
        keras.utils.set_random_seed(99)  # other initial values
        model = models.mlp(keras)
        model.load_weights(os.path.join(directory, "mlp.weights.h5"))
        out["load_weights"] = model.get_weights()
        out["local_up"] = tuple(
            model.get_layer("up").kernel.value.to_local().shape
        )
        # set_weights/assign keep the layout.
        model.set_weights([w * 2 for w in out["load_weights"]])
        kernel = model.get_layer("up").kernel
        out["set_weights_local"] = tuple(kernel.value.to_local().shape)
        out["set_weights"] = keras.ops.convert_to_numpy(kernel.value)
        kernel.assign(np.ones(kernel.shape, "float32"))
        out["assign_is_dtensor"] = isinstance(kernel.value, DTensor)
        out["assign_sum"] = float(torch.sum(kernel.value.full_tensor()))

        loaded = keras.saving.load_model(os.path.join(directory, "mlp.keras"))
        out["inside_dtensor"] = isinstance(
            loaded.get_layer("up").kernel.value, DTensor
        )
        out["inside_predict"] = loaded.predict(x, verbose=0)
    loaded = keras.saving.load_model(os.path.join(directory, "mlp.keras"))
    out["outside_dtensor"] = isinstance(
        loaded.get_layer("up").kernel.value, DTensor
    )
    out["outside_predict"] = loaded.predict(x, verbose=0)

    # Loading reads only this rank's slices of a sharded weight.
    import tracemalloc

    table_map = keras.distribution.LayoutMap(distribution.device_mesh)
    table_map[".*table/embeddings"] = ("model", None)
    with keras.distribution.ModelParallel(layout_map=table_map).scope():

        def table():
            tokens = keras.Input((4,), dtype="int32")
            layer = keras.layers.Embedding(40_000, 32, name="table")
            return keras.Model(tokens, layer(tokens))

        saved = table()

        def load(name, **save_kwargs):
            """(peak numpy bytes of the load / the table, values equal)."""
            path = os.path.join(directory, name)
            saved.save_weights(path, **save_kwargs)
            fresh = table()
            tracemalloc.start()
            fresh.load_weights(path)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            same = np.array_equal(
                fresh.get_weights()[0], saved.get_weights()[0]
            )
            return peak / (40_000 * 32 * 4), bool(same)

        out["load_peak_fraction"], out["table_loaded"] = load(
            "table.weights.h5"
        )
        # The same from Keras's sharded format (`max_shard_size`, GB).
        out["json_load_peak_fraction"], out["json_table_loaded"] = load(
            "table.weights.json", max_shard_size=0.01
        )
        # Keras renames a sharded `.weights.h5` target to `.weights.json`.
        saved.save_weights(
            os.path.join(directory, "renamed.weights.h5"), max_shard_size=0.01
        )
        out["renamed"] = sorted(
            f for f in os.listdir(directory) if f.startswith("renamed")
        )

    # A save on one rank only would hang in its gather: it raises instead.
    os.environ["KERAS_DTENSOR_SAVE_TIMEOUT"] = "2"
    if torch.distributed.get_rank() == 0:
        try:
            with distribution.scope():
                model.save_weights(os.path.join(directory, "lone.weights.h5"))
        except RuntimeError as e:
            out["lone_error"] = str(e)
        try:
            with distribution.scope():
                _write_kernels(model, os.path.join(directory, "lone.h5"))
        except RuntimeError as e:
            out["lone_store_error"] = str(e)
    return out


def test_save_on_4_ranks_load_on_2_and_in_plain_keras(tmp_path):
    saved = run_ranks(_save, 4, str(tmp_path), timeout=300)
    # One writer, atomic rename: no temp files left behind, not even those
    # of an earlier killed save or of a failed one.
    # (Keras names a sharded save's files after the target: table_00000...)
    shards = [f for f in saved[0]["files"] if f.startswith("table_")]
    assert [f for f in saved[0]["files"] if f not in shards] == [
        "kernels.h5",
        "mlp.keras",
        "mlp.weights.h5",
        "table.keras",
        "table.weights.h5",
        "table.weights.json",
    ]
    assert shards == [f"table_{i:05}.weights.h5" for i in range(len(shards))]
    weights = saved[0]["weights"]
    _check_streamed_saves(saved, tmp_path)

    loaded = run_ranks(_load, 2, str(tmp_path))
    for out in loaded:
        for got, want in zip(out["load_weights"], weights, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-7)
        assert out["local_up"] == (16, 16)  # (16, 32) over 2 ranks
        assert out["set_weights_local"] == (16, 16)
        np.testing.assert_allclose(
            out["set_weights"], 2 * weights[0], atol=1e-6
        )
        assert out["assign_is_dtensor"]
        assert out["assign_sum"] == 16 * 32
        assert out["inside_dtensor"] and not out["outside_dtensor"]
        np.testing.assert_allclose(
            out["inside_predict"], saved[0]["predict"], atol=1e-6
        )
        np.testing.assert_allclose(
            out["outside_predict"], saved[0]["predict"], atol=1e-6
        )
        assert "failed on rank 0 of 2" in out["failed_save"]
        assert "missing" in out["failed_save"]
        assert out["failed_save_s"] < 30  # not the collective timeout
        assert out["table_loaded"] and out["json_table_loaded"]
        assert out["json_load_peak_fraction"] < 0.75, out
        assert out["renamed"] == [
            "renamed.weights.json",
            "renamed_00000.weights.h5",
        ]
        # Each of 2 ranks read half of the table (whole: 1.0 or more).
        assert out["load_peak_fraction"] < 0.75, out["load_peak_fraction"]
    assert "must be called on every rank" in loaded[0]["lone_error"]
    assert "lone.weights.h5" in loaded[0]["lone_error"]
    assert " s of 2 s (KERAS_DTENSOR_SAVE_TIMEOUT)" in loaded[0]["lone_error"]
    # A store opened by hand: the same error, naming the function.
    lone_store = loaded[0]["lone_store_error"]
    assert "_write_kernels(" in lone_store and "lone.h5" in lone_store
    assert "must be called on every rank" in lone_store
    assert not (tmp_path / "lone.h5").exists()

    # Plain single-process Keras reads both files.
    import models

    x, _ = models.data("mlp")
    plain = keras.saving.load_model(str(tmp_path / "mlp.keras"))
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), saved[0]["predict"], atol=1e-6
    )
    plain_weights = models.mlp(keras)
    plain_weights.load_weights(str(tmp_path / "mlp.weights.h5"))
    for got, want in zip(plain_weights.get_weights(), weights, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-7)
    # The store written by hand holds every kernel whole (rank 0's file).
    kernels = _read_kernels(str(tmp_path / "kernels.h5"))
    assert len(kernels) == 3, sorted(kernels)
    for name, kernel in kernels.items():
        want = keras.ops.convert_to_numpy(plain_weights.get_layer(name).kernel)
        np.testing.assert_array_equal(kernel, want)


def _check_streamed_saves(saved, tmp_path):
    # Only one replica of each shard sends it: rank 0 holds the first.
    assert [rank for rank, _ in saved[0]["owners"]] == [0, 1]
    assert [ranges for _, ranges in saved[0]["owners"]] == [
        ((0, TABLE[0]), (0, 64)),
        ((0, TABLE[0]), (64, 64)),
    ]
    for rank, out in enumerate(saved):
        # No rank held a whole copy of the table (gathering it: 2x).
        for what in ("peak_save_weights", "peak_save", "peak_save_sharded"):
            assert out[what] < 0.3 * TABLE_MB, (rank, what, out[what])
        # A write failing on rank 0: no peer left waiting.
        for error, seconds in (out["full_disk"], out["full_disk_config"]):
            assert seconds < 30, seconds
            if rank == 0:
                assert error.startswith("OSError"), error
            else:
                assert "failed on rank 0 of 4: OSError" in error, error
            assert "File too large" in error

    # Plain Keras reads the same values, bfloat16 and optimizer included:
    # every rank's shards, replicas too.
    plain = keras.saving.load_model(str(tmp_path / "table.keras"))
    fresh = _table_model(keras)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(str(tmp_path / "table.weights.h5"))
    from_json = _table_model(keras)
    from_json.optimizer.build(from_json.trainable_variables)
    from_json.load_weights(str(tmp_path / "table.weights.json"))
    assert sum(f.startswith("table_") for f in saved[0]["files"]) > 1
    for loaded in (plain, fresh, from_json):
        values = [keras.ops.convert_to_numpy(v) for v in _variables(loaded)]
        for out in saved:
            for value, (ranges, crc) in zip(
                values, out["checksums"], strict=True
            ):
                index = tuple(slice(a, a + n) for a, n in ranges)
                assert _checksum(value[index]) == crc


@pytest.mark.parametrize(
    "shape, itemsize, piece_bytes",
    [
        ((), 4, 16),
        ((0, 5), 4, 16),
        ((7,), 2, 6),
        ((5, 3), 4, 24),
        ((3, 4, 5), 4, 12),
        ((3, 4, 5), 8, 4),  # less than one element: one element each
        ((2, 3, 4), 4, 1000),
    ],
)
def test_pieces_are_contiguous_bounded_and_in_file_order(
    shape, itemsize, piece_bytes
):
    from keras_dtensor.saving.h5_stream import pieces

    flat = np.arange(int(np.prod(shape))).reshape(shape)
    covered = []
    for block in pieces(shape, itemsize, piece_bytes):
        part = flat[tuple(slice(a, b) for a, b in block)].reshape(-1)
        assert part.size * itemsize <= max(piece_bytes, itemsize)
        covered.extend(part.tolist())
    assert covered == list(range(flat.size))  # each once, in file order
