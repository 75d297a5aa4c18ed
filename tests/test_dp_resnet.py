"""A residual network with BatchNormalization under DataParallel gives one
process's numbers: a plain Keras ResNet-style block (convolutions without
bias, each followed by BatchNormalization with momentum 0.9, a projection
shortcut with its own BatchNormalization, Add, max and global average
pooling), and keras_hub's ResNetImageClassifier on a tiny ResNetBackbone
(basic blocks). SGD with momentum, 2 epochs with validation data, an uneven
last batch. Rank 0 also runs each case with no distribution (the
reference), in the same spawned group. SGD's update is the gradient times
lr, so a wrong gradient shows; statistics of each process's own rows
(`KERAS_DTENSOR_SYNC_BATCH_NORM=0`) miss by 1e-2 or more.

A ReLU input within rounding of 0 takes either side of the kink depending
on the order of the sums (rows per process, or rows reordered in one
process): its gradient is then all or nothing, and momentum carries that
to 1e-3 over a few steps (issue 51: seeds where 2 processes drift and 4 do
not, and the reverse). So the ReLU cases use data where no input lands
there, and a third case runs the keras_hub ResNet of that report (8 rows
per process, 64 filters then 32) with GELU in place of ReLU: no kink, so
any gap past rounding is a wrong term, whatever the data."""

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

# Relative to max(1, |value|): the moving variances reach about 7, where
# summation order alone moves them by 1e-6 (seen: 2.3e-6 at 2 and 4
# processes).
TOLERANCE = 2e-5
ROWS, BATCH, VALIDATION = 29, 8, 13  # uneven last batches: 5 and 5 rows


def _data(size):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(ROWS, size, size, 3)).astype("float32") * 2 + 0.5
    y = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    return x, y


def _plain(keras):
    def conv(h, filters, kernel, strides, name):
        h = keras.layers.Conv2D(
            filters,
            kernel,
            strides=strides,
            padding="same",
            use_bias=False,
            name=f"{name}_conv",
        )(h)
        return keras.layers.BatchNormalization(
            momentum=0.9, epsilon=1e-5, name=f"{name}_bn"
        )(h)

    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Activation("relu")(conv(inputs, 6, 3, 1, "stem"))
    h = keras.layers.MaxPooling2D(3, strides=1, padding="same")(h)
    # Identity shortcut, then a strided block with a projection shortcut:
    # two BatchNormalizations read the same input's descendants and meet
    # in the Add.
    for name, filters, strides in (("a", 6, 1), ("b", 8, 2)):
        shortcut = h
        if strides > 1:
            shortcut = conv(h, filters, 1, strides, f"{name}0")
        m = keras.layers.Activation("relu")(
            conv(h, filters, 3, strides, f"{name}1")
        )
        m = conv(m, filters, 3, 1, f"{name}2")
        h = keras.layers.Activation("relu")(keras.layers.Add()([shortcut, m]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(3, name="out")(h)
    return keras.Model(inputs, outputs), 8


def _keras_hub(keras):
    import keras_hub

    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],  # the first stack must have 64 filters
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 8],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        image_shape=(16, 16, 3),
    )
    model = keras_hub.models.ResNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=None
    )
    return model, 16


def _keras_hub_smooth(keras):
    import keras_hub

    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(16, 16, 3),
    )
    for layer in backbone._flatten_layers():
        if isinstance(layer, keras.layers.Activation):
            layer.activation = keras.activations.gelu
    model = keras_hub.models.ResNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=None
    )
    return model, 16


def _train(build, distribution, batch=BATCH):
    import contextlib

    import keras

    keras.utils.set_random_seed(0)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model, size = build(keras)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        x, y = _data(size)
        history = model.fit(
            x,
            y,
            batch_size=batch,
            epochs=2,
            shuffle=False,
            validation_data=(x[:VALIDATION], y[:VALIDATION]),
            verbose=0,
        )
        return {
            "paths": [w.path for w in model.weights],
            "weights": [np.asarray(w) for w in model.get_weights()],
            "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=batch, verbose=0),
            "predict": model.predict(x, batch_size=batch, verbose=0),
        }


def _diffs(got, want):
    def gap(a, b):
        a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
        return float((np.abs(a - b) / np.maximum(1.0, np.abs(b))).max())

    diffs = {
        path: gap(a, b)
        for path, a, b in zip(
            want["paths"], got["weights"], want["weights"], strict=True
        )
    }
    diffs["predict"] = gap(got["predict"], want["predict"])
    diffs["evaluate"] = gap(got["evaluate"], want["evaluate"])
    for key, values in want["history"].items():
        diffs[key] = gap(got["history"][key], values)
    return diffs


def _cases():
    import keras
    import torch.distributed as dist

    out = {}
    for name, build, batch in (
        ("plain", _plain, BATCH),
        ("keras_hub", _keras_hub, BATCH),
        ("keras_hub_gelu", _keras_hub_smooth, 2 * BATCH),
    ):
        reference = _train(build, None, batch) if dist.get_rank() == 0 else None
        got = _train(build, keras.distribution.DataParallel(), batch)
        if reference is not None:
            out[name] = {"diffs": _diffs(got, reference), "got": got}
    return out


def test_resnet_batch_norm_under_data_parallel_equals_one_process():
    pytest.importorskip("keras_hub")
    # keras_hub's fit batches numpy input with tf.data (or grain).
    out = run_ranks(_cases, 2, timeout=300, tensorflow=True)[0]
    for name, case in out.items():
        diffs = case["diffs"]
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= TOLERANCE, (name, worst, diffs[worst], diffs)
        # The moving statistics moved and training changed the loss (the
        # comparison can fail).
        got = case["got"]
        moving = [
            w
            for p, w in zip(got["paths"], got["weights"], strict=True)
            if p.endswith("moving_mean")
        ]
        assert min(np.abs(m).max() for m in moving) > 1e-3, name
        assert got["history"]["loss"][0] != got["history"]["loss"][1], name
