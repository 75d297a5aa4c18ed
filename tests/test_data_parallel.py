"""DataParallel with global-batch semantics, for every input kind.

Each rank trains the same model as plain one-process Keras (in the same
process) and under `DataParallel`; history, evaluate, predict and weights
must agree to 1e-5, including uneven last batches, sample weights,
validation data and shuffling.
"""

import contextlib
import io
import warnings

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
ROWS = 60  # not a multiple of the batch size: the last batch is uneven


def _arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 16)).astype("float32")
    y = rng.normal(size=(ROWS, 4)).astype("float32")
    return x, y


def _inputs(keras, kind):
    """fit() arguments for one input kind, yielding batches of 8."""
    import torch

    x, y = _arrays()
    if kind == "numpy":
        return dict(x=x, y=y, batch_size=8)  # shuffle=True, the default
    if kind == "dataloader":
        dataset = torch.utils.data.TensorDataset(
            torch.from_numpy(x), torch.from_numpy(y)
        )
        # A custom sampler must be kept: reversed order.
        sampler = list(reversed(range(ROWS)))
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=8, sampler=sampler
        )
        return dict(x=loader)
    if kind == "pydataset":

        class Rows(keras.utils.PyDataset):
            def __len__(self):
                return -(-ROWS // 8)

            def __getitem__(self, i):
                return x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

        return dict(x=Rows())
    if kind == "generator":

        def batches():
            while True:
                for i in range(0, ROWS, 8):
                    yield x[i : i + 8], y[i : i + 8]

        return dict(x=batches(), steps_per_epoch=-(-ROWS // 8))
    if kind == "tfdata":
        import tensorflow as tf

        # Shuffled each epoch: the seed makes it the same on every rank.
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        return dict(x=dataset.shuffle(ROWS).batch(8))
    raise ValueError(kind)


def _fit(keras, distribution, kind, verbose=0, optimizer="adam"):
    import models

    keras.utils.set_random_seed(6)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    x, y = _arrays()
    with scope:
        model = models.mlp(keras)
        if optimizer == "loss_scale":
            # Overrides apply(): gradients must be reduced before it runs.
            optimizer = keras.optimizers.LossScaleOptimizer(
                keras.optimizers.Adam()
            )
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
        kwargs = _inputs(keras, kind)
        if kind == "numpy":
            kwargs["sample_weight"] = np.linspace(0.5, 1.5, ROWS).astype(
                "float32"
            )
            kwargs["validation_data"] = (x[:20], y[:20])
        history = model.fit(epochs=2, verbose=verbose, **kwargs)
        return {
            "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=7, verbose=0),
            "predict": model.predict(x, batch_size=7, verbose=0),
            "weights": model.get_weights(),
        }


def _late_tracker(keras, distribution):
    """A train step that writes the loss tracker again after backward: the
    tracker's sum launched when backward started is stale by then, and
    the logged loss must still be the one-process one."""
    import models

    class Late(keras.Model):
        def train_step(self, data):
            super().train_step(data)
            rows = keras.tree.flatten(data)[0].shape[0]
            self._loss_tracker.update_state(7.0, sample_weight=rows)
            return self.get_metrics_result()

    keras.utils.set_random_seed(6)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    x, y = _arrays()
    with scope:
        base = models.mlp(keras)
        model = Late(base.inputs, base.outputs)
        model.compile(optimizer="adam", loss="mse")
        return model.fit(x, y, batch_size=8, epochs=2, verbose=0).history


def _collectives_per_train_step(keras, metrics):
    """Collectives of one `train_on_batch` under DataParallel, by kind."""
    import models
    from torch.distributed.tensor.debug import CommDebugMode

    x, y = _arrays()
    with keras.distribution.DataParallel().scope():
        model = models.mlp(keras)
        model.compile(optimizer="adam", loss="mse", metrics=list(metrics))
        model.train_on_batch(x[:8], y[:8])  # builds, broadcasts weights
        comm = CommDebugMode()
        with comm:
            logs = model.train_on_batch(x[:8], y[:8], return_dict=True)
    return (
        {str(k): v for k, v in comm.get_comm_counts().items()},
        sorted(logs),
    )


def _bfloat16_first_loss(keras, distribution):
    """The loss logged by the first `train_on_batch` of a bfloat16 model.
    Before any update it is the same on any process count up to float32
    rounding, so a loss sum rounded to bfloat16 (as a bfloat16 gradient
    bucket would carry it) shows."""
    keras.utils.set_random_seed(6)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    x, y = _arrays()
    with scope:
        model = keras.Sequential(
            [keras.layers.Dense(16, dtype="bfloat16"), keras.layers.Dense(1)]
        )
        model.compile(optimizer="sgd", loss="mse")
        return float(model.train_on_batch(x[:8], y[:8]))


def _rows_computed(keras):
    """Rows a layer computes on in the first `train_on_batch` calls of a
    model built by them (a pass on `meta` only infers shapes)."""
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            if x.device.type != "meta":
                seen.append(int(x.shape[0]))
            return x

    x, y = _arrays()
    with keras.distribution.DataParallel().scope():
        model = keras.Sequential([Probe(), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        model.train_on_batch(x[:32], y[:32])
        model.train_on_batch(x[:32], y[:32])
    return seen


def _input_kinds(kinds):
    import keras
    import models

    out = {}
    for kind in kinds:
        reference = _fit(keras, None, kind)
        result = _fit(keras, keras.distribution.DataParallel(), kind)
        out[kind] = {
            "diff": models.max_diff(reference, result),
            "history": result["history"],
        }
    reference = _fit(keras, None, "numpy", optimizer="loss_scale")
    result = _fit(
        keras,
        keras.distribution.DataParallel(),
        "numpy",
        optimizer="loss_scale",
    )
    out["loss_scale"] = models.max_diff(reference, result)
    reference = _late_tracker(keras, None)["loss"]
    result = _late_tracker(keras, keras.distribution.DataParallel())["loss"]
    out["late_tracker"] = float(np.abs(np.subtract(reference, result)).max())
    out["collectives"] = {
        metrics: _collectives_per_train_step(keras, metrics)
        for metrics in ((), ("mae", "mse"))
    }
    out["rows_computed"] = _rows_computed(keras)
    reference = _bfloat16_first_loss(keras, None)
    loss = _bfloat16_first_loss(keras, keras.distribution.DataParallel())
    out["bfloat16"] = abs(loss - reference) / abs(reference)
    # Progress bars print on rank 0 only.
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        _fit(keras, keras.distribution.DataParallel(), "numpy", verbose=2)
    out["stdout"] = stdout.getvalue()
    return out


def _per_process_slices():
    """auto_shard_dataset=False: each process feeds its own rows."""
    import keras
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = _arrays()
    x, y = x[:48], y[:48]  # 6 global batches of 8
    local = 8 // world
    # Global batch i is rank 0's rows, then rank 1's, ...: one process
    # trains on exactly these batches in this order.
    mine = np.concatenate(
        [
            np.arange(i * 8 + rank * local, i * 8 + (rank + 1) * local)
            for i in range(6)
        ]
    )
    results = []
    for distribution in (
        None,
        keras.distribution.DataParallel(auto_shard_dataset=False),
    ):
        import models

        keras.utils.set_random_seed(6)
        scope = (
            distribution.scope() if distribution else contextlib.nullcontext()
        )
        with scope:
            model = models.mlp(keras)
            model.compile(optimizer="sgd", loss="mse")
            if distribution is None:
                history = model.fit(
                    x, y, batch_size=8, shuffle=False, verbose=0
                )
            else:
                history = model.fit(
                    x[mine], y[mine], batch_size=local, shuffle=False, verbose=0
                )
            # Each rank predicts its rows; the gathered result is global.
            predicted = (
                model.predict(x, batch_size=8, verbose=0)
                if distribution is None
                else model.predict(x[mine], batch_size=local, verbose=0)
            )
            results.append(
                (history.history["loss"], model.get_weights() + [predicted])
            )
    (h0, w0), (h1, w1) = results
    diff = max(
        [abs(a - b) for a, b in zip(h0, h1, strict=True)]
        + [float(np.abs(a - b).max()) for a, b in zip(w0, w1, strict=True)]
    )
    # Ranks with different numbers of batches: a clear error on every
    # rank, not a hang.
    distribution = keras.distribution.DataParallel(auto_shard_dataset=False)
    with distribution.scope():
        model = models.mlp(keras)
        model.compile(optimizer="sgd", loss="mse")
        rows = 8 if rank == 0 else 12
        try:
            model.fit(x[:rows], y[:rows], batch_size=4, verbose=0)
            error = None
        except RuntimeError as e:
            error = str(e)
    # A global-batch pipeline seeded differently per rank (here: a torch
    # DataLoader shuffled by torch's seeded generator; Keras 3.16 shuffles
    # arrays by epoch number alone) would silently train on the wrong rows:
    # it raises.
    import torch

    keras.utils.set_random_seed(100 + rank)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)),
        batch_size=8,
        shuffle=True,
    )
    with keras.distribution.DataParallel().scope():
        model = models.mlp(keras)
        model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(loader, verbose=0)
            diverged = None
        except RuntimeError as e:
            diverged = str(e)
    return diff, error, diverged


KINDS = ["numpy", "dataloader", "pydataset", "generator"]


def _tf_data_cases():
    """tf.data under DataParallel and under ModelParallel meshes."""
    import keras
    import models
    import tensorflow as tf

    # One line says that tf.data is read whole by every process.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _input_kinds(["tfdata"])
    out["read_whole_said"] = sum(
        "reads this tf.data pipeline whole" in str(w.message) for w in caught
    )
    # Checked by test_every_input_kind_matches_one_process.
    for key in ("stdout", "loss_scale", "collectives", "rows_computed"):
        del out[key]
    world = keras.distribution.get_device_count()
    x, y = _arrays()

    def fit(distribution):
        keras.utils.set_random_seed(6)
        scope = (
            distribution.scope() if distribution else contextlib.nullcontext()
        )
        with scope:
            model = models.mlp(keras)
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
            history = model.fit(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
                epochs=2,
                verbose=0,
            )
            return {
                "history": history.history,
                "evaluate": model.evaluate(
                    tf.data.Dataset.from_tensor_slices((x, y)).batch(7),
                    verbose=0,
                ),
                "predict": model.predict(
                    tf.data.Dataset.from_tensor_slices(x).batch(7), verbose=0
                ),
                "weights": model.get_weights(),
            }

    reference = fit(None)
    for shape in ((world, 1), (1, world)):
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"])
        distribution = keras.distribution.ModelParallel(
            layout_map=models.layout_map(keras, mesh, models.TP_LAYOUTS["mlp"])
        )
        out[f"model_parallel{shape}"] = models.max_diff(
            reference, fit(distribution)
        )
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tf_data_matches_one_process(world):
    # Keras would rebatch and shard tf.data per process (8 and 7 batches
    # for these 60 rows); here it is one global batch, as on one process.
    pytest.importorskip("tensorflow")
    for out in run_ranks(_tf_data_cases, world, timeout=400, tensorflow=True):
        assert out.pop("tfdata")["diff"] <= TOLERANCE
        assert out.pop("read_whole_said") == 1
        for case, diff in out.items():
            assert diff <= TOLERANCE, case


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def input_kinds(request):
    """One run of `_input_kinds` per world size, shared by the tests below
    (each checks one behaviour): `(world, results by rank)`."""
    world = request.param
    return world, run_ranks(_input_kinds, world, KINDS, timeout=400)


def test_every_input_kind_matches_one_process(input_kinds):
    world, results = input_kinds
    for rank, out in enumerate(results):
        for kind in KINDS:
            assert out[kind]["diff"] <= TOLERANCE, (
                world,
                rank,
                kind,
                out[kind],
            )
            assert out[kind]["history"] == results[0][kind]["history"]


def test_loss_scale_optimizer_and_a_late_tracker_match_one_process(
    input_kinds,
):
    # LossScaleOptimizer overrides apply(): gradients must be reduced
    # before it runs; a tracker written again after backward must still
    # log the one-process loss.
    for out in input_kinds[1]:
        assert out["loss_scale"] <= TOLERANCE
        assert out["late_tracker"] <= TOLERANCE


def test_one_collective_per_step_with_metrics_in_the_bucket(input_kinds):
    # The loss tracker and the compiled metrics are summed in the
    # gradient bucket's all-reduce: one collective per step, as DDP's.
    for out in input_kinds[1]:
        (plain, _), (metrics, logs) = out["collectives"].values()
        assert plain == metrics, out["collectives"]
        assert plain == {"c10d.allreduce_": 1}, plain
        assert logs == ["loss", "mae", "mse"], logs


def test_a_bfloat16_bucket_does_not_round_the_loss_sum(input_kinds):
    for out in input_kinds[1]:
        assert out["bfloat16"] <= 1e-6, out["bfloat16"]


def test_the_first_train_on_batch_computes_only_this_ranks_rows(input_kinds):
    world, results = input_kinds
    for out in results:
        assert out["rows_computed"] == [32 // world] * 2, out["rows_computed"]


def test_progress_bars_print_on_rank_0_only(input_kinds):
    for rank, out in enumerate(input_kinds[1]):
        if rank == 0:
            assert "loss" in out["stdout"] and "Epoch 2/2" in out["stdout"]
        else:
            assert out["stdout"] == ""


def test_auto_shard_false_means_each_process_feeds_its_rows():
    for diff, error, diverged in run_ranks(_per_process_slices, 2):
        assert diff <= TOLERANCE
        assert "batch 0 of this epoch differs" in diverged
        assert "ranks with equal batches: [[0], [1]]" in diverged
        assert "ranks [0] have 2 batches this epoch while ranks [1]" in error
        assert "(batches per rank: [2, 3])" in error
