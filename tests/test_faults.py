"""Faults and shared files: Keras callbacks with the same arguments on every
process, interrupted and resumed runs, against one process."""

import os

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

EPOCHS = 4


def _callbacks(keras, root):
    return [
        keras.callbacks.BackupAndRestore(os.path.join(root, "backup")),
        keras.callbacks.ModelCheckpoint(
            os.path.join(root, "ckpt", "w-{epoch}.weights.h5"),
            save_weights_only=True,
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(root, "best", "best.keras"),
            monitor="loss",
            save_best_only=True,
        ),
        keras.callbacks.CSVLogger(os.path.join(root, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(root, "tb"), histogram_freq=1),
    ]


def _listing(root):
    files = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.relpath(os.path.join(folder, name), root)
            # TensorBoard names event files after the host and process.
            files.append(path.split(".out.tfevents.")[0])
    return sorted(files)


def _train_with_callbacks(root, strategy):
    """Interrupted at epoch 2 and resumed (in `root/a`); uninterrupted (in
    `root/b`). Every rank passes the same paths, as a script would."""
    import keras
    import models

    world = len(keras.distribution.list_devices())
    if strategy == "model_parallel":
        mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=models.layout_map(
                    keras, mesh, models.TP_LAYOUTS["mlp"]
                )
            )
        )
    elif strategy == "data_parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    x, y = models.data("mlp")

    def build():
        keras.utils.set_random_seed(3)
        model = models.MODELS["mlp"](keras)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        return model

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted on purpose")

    fit = dict(x=x, y=y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)
    a = os.path.join(root, "a")
    with pytest.raises(RuntimeError, match="on purpose"):
        build().fit(callbacks=_callbacks(keras, a) + [Interrupt()], **fit)
    resumed = build()
    history = resumed.fit(callbacks=_callbacks(keras, a), **fit).history
    uninterrupted = build()
    uninterrupted.fit(
        callbacks=_callbacks(keras, os.path.join(root, "b")), **fit
    )
    best = keras.saving.load_model(os.path.join(a, "best", "best.keras"))
    last = build()
    last.load_weights(os.path.join(a, "ckpt", f"w-{EPOCHS}.weights.h5"))
    with open(os.path.join(a, "log.csv")) as f:
        csv = f.read()
    return {
        "history": history,
        "weights": [np.asarray(w) for w in resumed.get_weights()],
        "uninterrupted": [np.asarray(w) for w in uninterrupted.get_weights()],
        "best": [np.asarray(w) for w in best.get_weights()],
        "last_checkpoint": [np.asarray(w) for w in last.get_weights()],
        "files": _listing(a),
        "csv_rows": csv.splitlines(),
    }


def _same(a, b, tolerance=0.0):
    assert len(a) == len(b)
    for p, q in zip(a, b, strict=True):
        np.testing.assert_allclose(p, q, rtol=0, atol=tolerance)


@pytest.mark.parametrize("strategy", ["model_parallel", "data_parallel"])
def test_callbacks_on_two_processes_equal_one_process(tmp_path, strategy):
    (one,) = run_ranks(
        _train_with_callbacks, 1, str(tmp_path / "one"), None, tensorflow=True
    )
    ranks = run_ranks(
        _train_with_callbacks,
        2,
        str(tmp_path / "two"),
        strategy,
        tensorflow=True,
    )
    for got in ranks:
        # A resumed fit equals an uninterrupted one, bit for bit.
        _same(got["weights"], got["uninterrupted"])
        # Files written once, as by one process (no backup left behind;
        # TensorBoard: one event file per fit, not per rank).
        assert got["files"] == one["files"], (got["files"], one["files"])
        _same(got["weights"], one["weights"], 1e-5)
        _same(got["last_checkpoint"], got["weights"])
        _same(got["best"], got["weights"])
        assert got["csv_rows"][0] == one["csv_rows"][0]
        assert len(got["csv_rows"]) == len(one["csv_rows"])
        for key, values in one["history"].items():
            np.testing.assert_allclose(got["history"][key], values, atol=1e-5)
    assert ranks[0]["history"] == ranks[1]["history"]


def _divergence_cases():
    """Each case returns (error message, seconds until the error)."""
    import time

    import keras
    import models
    import torch.distributed as dist

    rank = dist.get_rank()
    x, y = models.data("mlp")
    out = {}

    def build():
        keras.utils.set_random_seed(3)
        model = models.MODELS["mlp"](keras)
        model.compile(optimizer="sgd", loss="mse")
        return model

    def error_of(fit_args, **kwargs):
        model = build()
        start = time.monotonic()
        try:
            model.fit(*fit_args, batch_size=4, epochs=1, verbose=0, **kwargs)
        except RuntimeError as e:
            return str(e), time.monotonic() - start
        return None, time.monotonic() - start

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    # Batches 0-9 equal, then rank 1's rows differ: found at batch 10
    # (KERAS_DTENSOR_CHECK_EVERY=10).
    x_late = x.copy()
    if rank == 1:
        x_late[40:] += 1.0
    out["late"] = error_of((x_late, y), shuffle=False)
    # One rank has one more batch (a known count): raised up front.
    n = 64 if rank == 0 else 68
    out["count"] = error_of(
        (
            x[:n] if n <= 64 else np.concatenate([x, x[:4]]),
            y[:n] if n <= 64 else np.concatenate([y, y[:4]]),
        )
    )

    # A generator (unknown count) with one more batch on rank 1.
    def batches():
        for i in range(5 + rank):
            yield x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]

    out["generator"] = error_of((batches(),))
    # A callback's file in a missing directory: rank 0's error, on every
    # rank, as plain Keras raises it (one "[Errno 2]", the path).
    logger = keras.callbacks.CSVLogger("/nonexistent-keras-dtensor/log.csv")
    try:
        build().fit(x, y, batch_size=4, verbose=0, callbacks=[logger])
        out["missing"] = None
    except OSError as e:
        out["missing"] = type(e).__name__, e.errno, e.filename, str(e)

    # Ranks that build different models (a rank-dependent width).
    keras.utils.set_random_seed(3)
    inputs = keras.Input((models.WIDTH,))
    odd = keras.Model(inputs, keras.layers.Dense(4 + rank)(inputs))
    odd.compile(optimizer="sgd", loss="mse")
    start = time.monotonic()
    try:
        odd.fit(x, y[:, : 4 + rank], batch_size=4, verbose=0)
        out["models"] = None, 0.0
    except RuntimeError as e:
        out["models"] = str(e), time.monotonic() - start
    # A DataParallel mesh that does not hold every process.
    try:
        keras.distribution.DataParallel(devices=["cpu:0"]).scope().__enter__()
        out["devices"] = None
    except ValueError as e:
        out["devices"] = str(e)

    # Replicated weights diverge: a callback that acts on one rank only.
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"])
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=models.layout_map(keras, mesh, models.TP_LAYOUTS["mlp"])
        )
    )

    class OnRankOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if rank == 1:
                bias = self.model.get_layer("out").bias
                bias.assign(bias + 1e-3)

    out["replicas"] = error_of((x, y), callbacks=[OnRankOne()])

    # Last (the group does not survive it): rank 1 stops in the middle of
    # fit and its process ends; rank 0 is left in a collective.
    class StopOnRankOne(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and batch == 2:
                raise KeyboardInterrupt

    start = time.monotonic()
    try:
        build().fit(x, y, batch_size=4, verbose=0, callbacks=[StopOnRankOne()])
        out["peer"] = None, 0.0
    except KeyboardInterrupt:
        out["peer"] = "stopped", 0.0
    except RuntimeError as e:
        out["peer"] = str(e), time.monotonic() - start
    return out


def test_divergence_and_uneven_data_raise_on_every_rank_within_seconds():
    results = run_ranks(_divergence_cases, 2)
    for out in results:
        late, seconds = out["late"]
        assert "batch 10 of this epoch differs" in late, late
        assert "ranks with equal batches: [[0], [1]]" in late
        assert seconds < 20
        count, seconds = out["count"]
        assert "(batches per rank: [16, 17])" in count, count
        assert seconds < 20
        generator, seconds = out["generator"]
        assert "ranks [0] have 5 batches this epoch" in generator, generator
        assert "(batches per rank: [5, 6])" in generator
        name, errno, filename, text = out["missing"]
        assert (name, errno) == ("FileNotFoundError", 2), out["missing"]
        assert filename == "/nonexistent-keras-dtensor/log.csv", filename
        assert text.count("[Errno") == 1, text
        assert "on rank 0 of 2, on behalf of every rank" in text, text
        models, seconds = out["models"]
        assert "built different models: ranks [1] of 2" in models, models
        assert seconds < 20
        assert "has 1 devices ['cpu:0'], but this job has 2" in out["devices"]
        replicas, seconds = out["replicas"]
        assert "rank 1's copy of 1 weight(s) differs from rank 0's" in replicas
        assert "mlp/out/bias" in replicas or "out/bias" in replicas, replicas
    assert results[1]["peer"][0] == "stopped"
    peer, seconds = results[0]["peer"]
    assert "fit on rank 0 of 2 stopped: a collective" in peer, peer
    assert seconds < 30
