"""DataParallel gives one process's numbers for batch-dependent layers:
BatchNormalization (global statistics by default, and with
synchronized=True; one with renormalization), next to per-sample
statistics (GroupNormalization, which stay local), seeded random and
augmentation layers (which need
TensorFlow), at 2 and 4 processes, numpy and DataLoader input, an uneven
last batch. With per-process statistics (SYNC_BATCH_NORM=0) every rank
holds rank 0's moving statistics, so predict agrees with the model."""

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 2e-5
ROWS, BATCH = 58, 16  # last batch: 10 rows (uneven over 4 processes)


def _convnet(keras, synchronized):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((8, 8, 3))
    # Augmentation draws one value per image from the layer's seed.
    h = keras.layers.RandomFlip(seed=5)(inputs)
    h = keras.layers.RandomContrast(0.3, seed=6)(h)
    h = keras.layers.Conv2D(6, 3, padding="same", name="conv")(h)
    h = keras.layers.BatchNormalization(synchronized=synchronized, name="bn")(h)
    h = keras.layers.Activation("relu")(h)
    # Per-sample statistics (not over the batch): computed locally.
    h = keras.layers.GroupNormalization(groups=3, name="gn")(h)
    h = keras.layers.SpatialDropout2D(0.3, seed=1)(h)
    h = keras.layers.GaussianNoise(0.1, seed=2)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(8, name="hidden")(h)
    h = keras.layers.Dropout(0.3, seed=3)(h)
    h = keras.layers.GaussianDropout(0.2, seed=4)(h)
    h = keras.layers.BatchNormalization(
        synchronized=synchronized, renorm=True, name="bn_dense"
    )(h)
    outputs = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="mse",
        metrics=["mae"],
    )
    return model


def _data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(ROWS, 8, 8, 3)).astype("float32") * 2 + 0.5
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    return x, y


def _train(input_kind, synchronized=True):
    import keras
    import torch

    world = len(keras.distribution.list_devices())
    if world > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    x, y = _data()
    model = _convnet(keras, synchronized)
    if input_kind == "numpy":
        data = dict(x=x, y=y, batch_size=BATCH, shuffle=False)
    else:
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)),
            batch_size=BATCH,
        )
        data = dict(x=loader)
    history = model.fit(epochs=2, verbose=0, **data)
    # The same rows on this rank's weights alone, outside any step.
    whole = keras.ops.convert_to_numpy(model(x, training=False))
    return {
        "whole": whole,
        "weights": [np.asarray(w) for w in model.get_weights()],
        "paths": [w.path for w in model.weights],
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
        "predict": model.predict(x, batch_size=BATCH, verbose=0),
    }


def _compare(got, want):
    diffs = {
        path: float(np.abs(a - b).max())
        for path, a, b in zip(
            want["paths"], got["weights"], want["weights"], strict=True
        )
    }
    diffs["predict"] = float(np.abs(got["predict"] - want["predict"]).max())
    diffs["evaluate"] = float(
        np.abs(np.subtract(got["evaluate"], want["evaluate"])).max()
    )
    for key, values in want["history"].items():
        diffs[key] = float(
            np.abs(np.subtract(got["history"][key], values)).max()
        )
    return diffs


def _cases():
    import os

    # BatchNormalization without the flag: global statistics by default.
    out = {
        "numpy": _train("numpy", synchronized=False),
        "loader": _train("loader", synchronized=True),
    }
    os.environ["KERAS_DTENSOR_SYNC_BATCH_NORM"] = "0"
    try:
        out["per_process"] = _train("numpy", synchronized=False)
    finally:
        del os.environ["KERAS_DTENSOR_SYNC_BATCH_NORM"]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_batch_norm_and_seeded_noise_equal_one_process(world):
    (one,) = run_ranks(_cases, 1, tensorflow=True)
    outs = run_ranks(_cases, world, timeout=400, tensorflow=True)
    for out in outs:
        for kind in ("numpy", "loader"):
            diffs = _compare(out[kind], one[kind])
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] <= TOLERANCE, (kind, worst, diffs)
            # The moving statistics moved (the test can fail).
            moving = out[kind]["paths"].index("bn/moving_mean")
            assert np.abs(out[kind]["weights"][moving]).max() > 1e-3
    # Per-process statistics: rank 0's moving statistics on every rank
    # (not one process's), so predict's rows, computed by every rank,
    # agree with the whole batch on one rank's weights.
    ranks = [out["per_process"] for out in outs]
    moving = ranks[0]["paths"].index("bn/moving_mean")
    for got in ranks:
        for a, b in zip(got["weights"], ranks[0]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(got["predict"], got["whole"], atol=1e-5)
    own = np.abs(ranks[0]["weights"][moving] - one["numpy"]["weights"][moving])
    assert own.max() > 1e-4, own.max()
