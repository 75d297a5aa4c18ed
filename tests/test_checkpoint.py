"""Saving and loading under a distribution.

Files written by N ranks are ordinary Keras files: they load on a different
number of ranks, and in plain single-process Keras (this test process).
"""

import os

import keras
import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _distribution(keras, world):
    import models

    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    return keras.distribution.ModelParallel(
        layout_map=models.layout_map(keras, mesh, models.TP_LAYOUTS["mlp"])
    )


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
    with distribution.scope():
        model.save_weights(os.path.join(directory, "mlp.weights.h5"))
        model.save(os.path.join(directory, "mlp.keras"))
    return {
        "predict": result["predict"],
        "weights": result["weights"],
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

        path = os.path.join(directory, "table.weights.h5")
        saved = table()
        saved.save_weights(path)
        fresh = table()
        tracemalloc.start()
        fresh.load_weights(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out["load_peak_fraction"] = peak / (40_000 * 32 * 4)
        out["table_loaded"] = bool(
            np.array_equal(fresh.get_weights()[0], saved.get_weights()[0])
        )

    # A save on one rank only would hang in its gather: it raises instead.
    os.environ["KERAS_DTENSOR_SAVE_TIMEOUT"] = "2"
    if torch.distributed.get_rank() == 0:
        try:
            with distribution.scope():
                model.save_weights(os.path.join(directory, "lone.weights.h5"))
        except RuntimeError as e:
            out["lone_error"] = str(e)
    return out


def test_save_on_4_ranks_load_on_2_and_in_plain_keras(tmp_path):
    saved = run_ranks(_save, 4, str(tmp_path), timeout=300)
    # One writer, atomic rename: no temp files left behind, not even those
    # of an earlier killed save.
    assert saved[0]["files"] == ["mlp.keras", "mlp.weights.h5"]
    weights = saved[0]["weights"]

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
        assert out["table_loaded"]
        # Each of 2 ranks read half of the table (whole: 1.0 or more).
        assert out["load_peak_fraction"] < 0.75, out["load_peak_fraction"]
    assert "must be called on every rank" in loaded[0]["lone_error"]
    assert "lone.weights.h5" in loaded[0]["lone_error"]
    assert " s of 2 s (KERAS_DTENSOR_SAVE_TIMEOUT)" in loaded[0]["lone_error"]

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
