"""Workflows users bring from one process, on 2 real processes against one.

A custom `train_step`/`test_step` in the style of Keras's guide
"Customizing what happens in fit() with PyTorch" (compiled metrics, and
its own trackers), a global batch with fewer rows than processes, losses
a layer adds from its whole input, and the
`if rank == 0: model.save_weights(...)` idiom of torchrun scripts, and
thresholded metrics (AUC) under ModelParallel. One
spawned group runs every case (processes are the suite's cost); each rank
computes the one-process reference itself.
"""

import contextlib
import random

import numpy as np
from harness import run_ranks

TOLERANCE = 1e-5


def _custom_model(keras, torch, trackers):
    """The guide's model: its own `train_step` and `test_step`; with
    `trackers`, its own `Mean`/`MeanAbsoluteError` instead of compiled
    metrics; `extra` logs a value of this rank's own."""

    class Custom(keras.Model):
        def __init__(self, *args, extra=False, **kwargs):
            super().__init__(*args, **kwargs)
            self.extra = extra
            if trackers:
                self.loss_tracker = keras.metrics.Mean(name="loss")
                self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

        @property
        def metrics(self):
            if trackers:
                return [self.loss_tracker, self.mae_metric]
            return super().metrics

        def _update(self, x, y, y_pred, loss):
            if trackers:
                self.loss_tracker.update_state(loss)
                self.mae_metric.update_state(y, y_pred)
            else:
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                    else:
                        metric.update_state(y, y_pred)
            logs = {m.name: m.result() for m in self.metrics}
            if self.extra:
                logs["first_row"] = float(y_pred[0, 0].item())
            return logs

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            if trackers:
                loss = keras.losses.mean_squared_error(y, y_pred).mean()
            else:
                loss = self.compute_loss(y=y, y_pred=y_pred)
            loss.backward()
            weights = list(self.trainable_weights)
            gradients = [v.value.grad for v in weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, weights)
            return self._update(x, y, y_pred, loss)

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            if trackers:
                loss = keras.losses.mean_squared_error(y, y_pred).mean()
            else:
                loss = self.compute_loss(y=y, y_pred=y_pred)
            return self._update(x, y, y_pred, loss)

    return Custom


def _fit(keras, distribution, build, compile_kwargs, x, y, **fit_kwargs):
    """Trains `build()` for 2 epochs with validation; what it saw."""
    keras.utils.set_random_seed(1)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model = build()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            **compile_kwargs,
        )
        history = model.fit(
            x,
            y,
            epochs=2,
            verbose=0,
            shuffle=False,
            validation_data=(x, y),
            **fit_kwargs,
        )
        # The script's next draw from Python's `random` (a shuffled
        # PyDataset's order, an unseeded initializer's seed): fit drew
        # what one process draws.
        after_fit = random.random()
        evaluated = model.evaluate(
            x, y, batch_size=8, verbose=0, return_dict=True
        )
        return {
            "history": history.history,
            "evaluate": evaluated,
            "predict": model.predict(x, batch_size=8, verbose=0),
            "weights": model.get_weights(),
            "random": after_fit,
        }


def _gap(a, b):
    """Largest difference between two `_fit` results (keys must agree)."""
    assert set(a["history"]) == set(b["history"]), (a, b)
    assert set(a["evaluate"]) == set(b["evaluate"]), (a, b)
    diffs = [
        float(np.abs(np.asarray(p) - np.asarray(q)).max())
        for p, q in zip(a["weights"], b["weights"], strict=True)
    ]
    diffs.append(float(np.abs(a["predict"] - b["predict"]).max()))
    diffs.append(abs(a["random"] - b["random"]))
    pairs = [(a["evaluate"][k], b["evaluate"][k]) for k in a["evaluate"]]
    for key, values in a["history"].items():
        pairs += zip(values, b["history"][key], strict=True)
    # A metric of several thresholds logs an array; a loss summed over
    # the batch is large: relative above 1.
    diffs += [
        float((np.abs(np.asarray(p) - q) / np.maximum(1.0, np.abs(p))).max())
        for p, q in pairs
    ]
    return max(diffs)


def _custom_steps(keras, torch, x, y):
    """Each custom-step model, one process against DataParallel, and the
    warnings DataParallel gave."""
    import warnings

    out = {}

    def mlp(cls, **kwargs):
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        return cls(inputs, keras.layers.Dense(2)(h), **kwargs)

    for trackers in (False, True):
        cls = _custom_model(keras, torch, trackers)
        kwargs = {} if trackers else {"loss": "mse", "metrics": ["mae"]}
        runs = [
            _fit(keras, d, lambda c=cls: mlp(c), kwargs, x, y, batch_size=16)
            for d in (None, keras.distribution.DataParallel())
        ]
        out["trackers" if trackers else "compiled"] = _gap(*runs)
    cls = _custom_model(keras, torch, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            keras,
            keras.distribution.DataParallel(),
            lambda: mlp(cls, extra=True),
            {"loss": "mse", "metrics": ["mae"]},
            x,
            y,
            batch_size=16,
        )
    out["warnings"] = [
        str(w.message) for w in caught if "DataParallel" in str(w.message)
    ]
    return out


def _few_rows(keras, x, y):
    """25 rows at batch size 8: the last batch has 1 row, so one of 2
    ranks gets none (BatchNormalization's global statistics and a seeded
    dropout in the model)."""

    def build():
        return keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.2, seed=3),
                keras.layers.Dense(2),
            ]
        )

    kwargs = {"loss": "mse", "metrics": ["mae"]}
    runs = [
        _fit(keras, d, build, kwargs, x[:25], y[:25], batch_size=8)
        for d in (None, keras.distribution.DataParallel())
    ]
    return _gap(*runs)


def _batch_losses(keras, x, y):
    """Losses a layer adds from its whole input (a router's balance, as
    an MoE's load-balancing loss: a product of two means over the batch;
    an activity regularizer's sum): at 32 rows (even shards, DTensors)
    and 25 (a last batch of one row: the gathered batch)."""

    class Balance(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.gate = keras.layers.Dense(4, name="gate")

        def call(self, x, training=None):
            p = keras.ops.softmax(self.gate(x), axis=-1)
            if training:  # as keras_hub's MoE blocks: not in Keras's build
                flat = keras.ops.reshape(p, (-1, 4))
                chosen = keras.ops.cast(flat > 0.25, "float32")
                balance = keras.ops.mean(chosen, axis=0) * keras.ops.mean(
                    flat, axis=0
                )
                self.add_loss(2.0 * keras.ops.sum(balance))
            return x * keras.ops.sum(p, axis=-1, keepdims=True)

    def balanced():
        inputs = keras.Input((3, 8))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        h = Balance(name="balance")(h)
        h = keras.layers.Dense(
            8, activity_regularizer=keras.regularizers.L2(0.01)
        )(h)
        return keras.Model(inputs, keras.layers.Dense(2)(h))

    def regularized():  # rows of features: Keras's loss per row is (rows,)
        inputs = keras.Input((8,))
        h = keras.layers.Dense(8, activation="relu", activity_regularizer="l2")(
            inputs
        )
        return keras.Model(inputs, keras.layers.Dense(2)(h))

    cases = {
        "balanced": (
            balanced,
            np.resize(x, (32, 3, 8)),
            np.resize(y, (32, 3, 2)),
        ),
        "regularized": (regularized, x[:32], y[:32]),
    }
    out = {}
    for name, (build, rows, targets) in cases.items():
        for n in (32, 25):
            runs = [
                _fit(
                    keras,
                    d,
                    build,
                    {"loss": "mse"},
                    rows[:n],
                    targets[:n],
                    batch_size=8,
                )
                for d in (None, keras.distribution.DataParallel())
            ]
            out[f"{name} {n}"] = _gap(*runs)
    return out


def _loss_reductions(keras, x, y):
    """Compiled losses that are no mean over rows (`reduction="sum"`,
    `"mean_with_sample_weight"`, a custom loss of the whole batch) and a
    custom per-row one, with sample weights, at 25 rows (a last batch of
    one row: a rank with none)."""

    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])

    def whole_batch(y_true, y_pred):
        return keras.ops.square(keras.ops.mean(y_true) - keras.ops.mean(y_pred))

    def per_row(y_true, y_pred):
        return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)

    losses = {
        "sum": lambda: keras.losses.MeanSquaredError(reduction="sum"),
        "mean_with_sample_weight": lambda: keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight"
        ),
        "whole_batch": lambda: whole_batch,
        "per_row": lambda: per_row,
    }
    weights = np.linspace(0.1, 2.0, 25).astype("float32")
    out = {}
    for name, loss in losses.items():
        runs = [
            _fit(
                keras,
                d,
                build,
                {"loss": loss()},
                x[:25],
                y[:25],
                batch_size=8,
                sample_weight=weights,
            )
            for d in (None, keras.distribution.DataParallel())
        ]
        out[name] = _gap(*runs)
    return out


def _thresholded_metrics(keras, x, y):
    """Metrics whose update scatters into threshold buckets (Keras's
    `segment_sum`: `scatter_reduce`, which torch's DTensor has no rule
    for) under ModelParallel, against one process."""

    def build():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
        return keras.Model(
            inputs, keras.layers.Dense(1, activation="sigmoid")(h)
        )

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    labels = (x[:, :1] > 0).astype("float32")
    runs = []
    for d in (None, keras.distribution.ModelParallel(layout_map=layout_map)):
        compiled = {  # each model its own metrics, as compile builds them
            "loss": "binary_crossentropy",
            "metrics": [
                keras.metrics.AUC(name="auc"),
                keras.metrics.Precision([0.3, 0.5, 0.7], name="precision"),
            ],
        }
        runs.append(_fit(keras, d, build, compiled, x, labels, batch_size=8))
    return _gap(*runs)


def _rank_0_saves(keras, torch, directory):
    """`if rank == 0: save` with no distribution set: plain Keras, alone;
    then under a distribution, alone: it raises after the timeout, having
    taken no part in rank 1's all-reduce meanwhile."""
    import os
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    path = os.path.join(directory, "alone.weights.h5")
    start = time.monotonic()
    if rank == 0:
        model.save_weights(path)
        model.save(os.path.join(directory, "alone.keras"))
        loaded = keras.saving.load_model(os.path.join(directory, "alone.keras"))
        loaded.load_weights(path)
        out["same"] = all(
            np.array_equal(a, b)
            for a, b in zip(
                model.get_weights(), loaded.get_weights(), strict=True
            )
        )
    out["alone_s"] = time.monotonic() - start
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["sum_after_plain"] = float(total)

    os.environ["KERAS_DTENSOR_SAVE_TIMEOUT"] = "2"
    try:
        with keras.distribution.DataParallel().scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        if rank == 0:
            try:
                with keras.distribution.DataParallel().scope():
                    model.save_weights(
                        os.path.join(directory, "lone.weights.h5")
                    )
            except RuntimeError as e:
                out["lone_error"] = str(e)
        total = torch.tensor([float(10 * (rank + 1))])
        dist.all_reduce(total)
        out["sum_after_lone"] = float(total)
    finally:
        del os.environ["KERAS_DTENSOR_SAVE_TIMEOUT"]
    return out


def _summary(keras):
    """What `model.summary()` printed on this rank."""
    import io

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.summary()
    return printed.getvalue()


def _workflows(directory):
    import keras
    import torch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")
    return {
        "custom": _custom_steps(keras, torch, x, y),
        "few_rows": _few_rows(keras, x, y),
        "batch_losses": _batch_losses(keras, x, y),
        "thresholded": _thresholded_metrics(keras, x, y),
        "reductions": _loss_reductions(keras, x, y),
        "saves": _rank_0_saves(keras, torch, directory),
        "summary": _summary(keras),
    }


def test_workflows_equal_one_process(tmp_path):
    for rank, out in enumerate(run_ranks(_workflows, 2, str(tmp_path))):
        custom = out["custom"]
        # The guide's custom steps log global loss and metrics: history,
        # evaluate, weights and predictions are one process's.
        assert custom["compiled"] <= TOLERANCE, custom
        assert custom["trackers"] <= TOLERANCE, custom
        # A value that is no metric's result stays the rank's own: said
        # once per step kind (train, test), from rank 0.
        if rank == 0:
            assert len(custom["warnings"]) == 2, custom["warnings"]
            assert "['first_row']" in custom["warnings"][0]
        else:
            assert custom["warnings"] == []
        # A last batch of one row on 2 processes trains as one process.
        assert out["few_rows"] <= TOLERANCE, out["few_rows"]
        # Losses added from the whole batch are the global batch's.
        assert max(out["batch_losses"].values()) <= TOLERANCE, out
        # Losses that are no mean over rows: computed on the global batch.
        assert max(out["reductions"].values()) <= TOLERANCE, out["reductions"]
        # AUC and thresholded precision under ModelParallel.
        assert out["thresholded"] <= TOLERANCE, out["thresholded"]
        saves = out["saves"]
        if rank == 0:
            assert saves["same"]
            assert saves["alone_s"] < 30, saves  # no wait for rank 1
            assert "must be called on every rank" in saves["lone_error"]
            assert "lone.weights.h5" in saves["lone_error"]
            assert "missing: rank 1" in saves["lone_error"], saves
        # model.summary() prints once, from rank 0.
        assert ("Total params" in out["summary"]) == (rank == 0), out
        assert saves["sum_after_plain"] == 3.0
        # Rank 0's lone save waited on the store, not in a collective
        # rank 1's all-reduce could pair with.
        assert saves["sum_after_lone"] == 30.0
