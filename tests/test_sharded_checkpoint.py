"""Sharded checkpoints (torch.distributed.checkpoint) from `fit`.

Saved by `ShardedCheckpoint` on 2 processes, resumed on 4 under another
mesh and layout (async saves), loaded on 2 under DataParallel and in plain
Keras in this process: always the weights of one uninterrupted process.
Damaged files raise on every rank before the model changes; metadata that
would run code is refused.
"""

import os
import pickle

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

EPOCHS = 3
TOLERANCE = 1e-5
TP = {".*up/kernel": (None, "model"), ".*mid/kernel": ("model", None)}


def _scope(distribution):
    import contextlib

    return distribution.scope() if distribution else contextlib.nullcontext()


def _model(keras, distribution=None):
    import models

    keras.utils.set_random_seed(3)
    with _scope(distribution):
        model = models.mlp(keras)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _fit(keras, distribution, epochs, callbacks=()):
    import models

    model = _model(keras, distribution)
    x, y = models.data("mlp")
    with _scope(distribution):
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
    return model, history


def _model_parallel(keras, shape):
    import models

    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"])
    return keras.distribution.ModelParallel(
        layout_map=models.layout_map(keras, mesh, TP)
    )


def _damaged_copies(root, latest):
    """Rank 0 makes damaged copies of `latest`; `{case: path}`."""
    import shutil

    import torch.distributed as dist

    cases = {}
    for case in ("truncated", "flipped", "missing", "uncommitted"):
        path = f"{root}-damaged-{case}"
        cases[case] = path
        if dist.get_rank() != 0:
            continue
        shutil.copytree(latest, path)
        shard = os.path.join(path, "__1_0.distcp")
        if case == "truncated":
            with open(shard, "r+b") as f:
                f.truncate(os.path.getsize(shard) - 5)
        elif case == "flipped":
            with open(shard, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 1]))
        elif case == "missing":
            os.remove(shard)
        else:
            os.remove(os.path.join(path, "keras_dtensor.json"))
    dist.barrier()
    return cases


def _first_epochs(root):
    """2 processes, (1, 2) mesh: 2 epochs, a checkpoint each, keep 1."""
    import keras

    import keras_dtensor

    distribution = _model_parallel(keras, (1, 2))
    callback = keras_dtensor.ShardedCheckpoint(root, keep=1)
    model, _ = _fit(keras, distribution, 2, [callback])
    out = {"listing": sorted(os.listdir(root))}
    latest = keras_dtensor.latest_checkpoint(root)
    before = model.get_weights()
    errors = {}
    for case, path in _damaged_copies(root, latest).items():
        try:
            keras_dtensor.load_checkpoint(model, path)
        except ValueError as e:
            errors[case] = str(e)
    after = model.get_weights()
    out["unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(before, after, strict=True)
    )
    out["errors"] = errors
    return out


def _resume(root):
    """4 processes, (2, 2) mesh: resumes at epoch 3, async saves."""
    import keras

    import keras_dtensor

    distribution = _model_parallel(keras, (2, 2))
    callback = keras_dtensor.ShardedCheckpoint(root, keep=2, async_save=True)
    ran = []

    class Ran(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            ran.append(epoch)

    model, history = _fit(keras, distribution, EPOCHS, [callback, Ran()])
    return {
        "ran": ran,
        "epochs": history.epoch,
        "weights": model.get_weights(),
        "listing": sorted(n for n in os.listdir(root) if n.startswith("c")),
    }


def _load_data_parallel(root, h5):
    """2 processes under DataParallel: load the newest, export to `.h5`."""
    import keras

    import keras_dtensor
    from keras_dtensor.checkpoint import api

    distribution = keras.distribution.DataParallel()
    model = _model(keras, distribution)
    with _scope(distribution):
        latest = keras_dtensor.latest_checkpoint(root)
        api.export_weights(model, latest, h5)
        return {
            "weights": model.get_weights(),
            "iterations": int(model.optimizer.iterations.numpy()),
        }


def test_save_on_2_resume_on_4_load_on_2_and_1_equal_one_process(tmp_path):
    import keras

    import keras_dtensor

    root = str(tmp_path / "ckpt")
    reference, _ = _fit(keras, None, EPOCHS)
    want = reference.get_weights()

    first = run_ranks(_first_epochs, 2, root)
    for out in first:
        assert out["listing"] == ["ckpt-0000000016"], out["listing"]
        assert out["unchanged"]
        errors = out["errors"]
        assert set(errors) == {"truncated", "flipped", "missing", "uncommitted"}
        assert "__1_0.distcp has" in errors["truncated"]
        assert "it holds model/" in errors["truncated"]
        assert "does not match its CRC-32 in bytes" in errors["flipped"]
        assert "__1_0.distcp is missing" in errors["missing"]
        assert (
            "not a complete keras-dtensor checkpoint" in (errors["uncommitted"])
        )

    resumed = run_ranks(_resume, 4, root, timeout=400)
    for out in resumed:
        assert out["ran"] == [EPOCHS - 1]  # only the last epoch ran
        # and fit's History holds every epoch, those before the resume too
        assert out["epochs"] == list(range(EPOCHS))
        assert out["listing"] == ["ckpt-0000000016", "ckpt-0000000024"]
        for got, expected in zip(out["weights"], want, strict=True):
            np.testing.assert_allclose(got, expected, atol=TOLERANCE)

    h5 = str(tmp_path / "export.weights.h5")
    for out in run_ranks(_load_data_parallel, 2, root, h5):
        assert out["iterations"] == 24
        for got, expected in zip(out["weights"], want, strict=True):
            np.testing.assert_allclose(got, expected, atol=TOLERANCE)

    # One process, plain Keras: the checkpoint and the exported file.
    plain = _model(keras)
    keras_dtensor.load_checkpoint(plain, keras_dtensor.latest_checkpoint(root))
    exported = _model(keras)
    exported.load_weights(h5)
    for a, b, expected in zip(
        plain.get_weights(), exported.get_weights(), want, strict=True
    ):
        np.testing.assert_allclose(a, expected, atol=TOLERANCE)
        np.testing.assert_array_equal(a, b)
    assert int(plain.optimizer.iterations.numpy()) == 24


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    from keras_dtensor.checkpoint import manifest

    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"storage_data": _Payload()}))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        manifest.read_metadata(str(path))
