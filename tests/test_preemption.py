"""A termination signal during `fit` costs nothing trained.

`ShardedCheckpoint` notes SIGTERM on whichever rank gets it, the ranks
agree on a step boundary, write a checkpoint there and exit with code 75;
started again, the run continues at that batch and ends with the weights,
optimizer state and history of a run that was never interrupted (bit for
bit: same processes, same order of operations). A checkpoint's name is
never lost to a kill, and a killed save leaves nothing behind after the
next one.
"""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import numpy as np
import pytest
from harness import run_ranks

SIGNAL_AT = 11  # the batch (1-based, over the run) a rank is signalled at

EPOCHS = 3


def _model(keras, kind, world):
    keras.utils.set_random_seed(0)
    devices = keras.distribution.list_devices()
    if kind == "dp":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh = keras.distribution.DeviceMesh(
            (1, world), ["batch", "model"], devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*up/kernel"] = (None, "model")
        layout_map[".*down/kernel"] = ("model", None)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(distribution)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu", name="up"),
            keras.layers.Dropout(0.3, seed=1),
            keras.layers.Dense(2, name="down"),
        ],
        name="net",
    )
    # SGD with momentum: optimizer state to restore, and no Adam to turn
    # rounding into lr-sized steps where runs on other processes compare.
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="mse",
        metrics=["mae"],
    )
    return model


def _data(shape=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(shape, 6)).astype("float32")
    y = rng.normal(size=(shape, 2)).astype("float32")
    return x, y


def _fit(directory, kind, signal_at=None, signalled_rank=1, data=None):
    """Trains 3 epochs of 8 batches (shuffled, with dropout); sends this
    process SIGTERM as batch `signal_at` begins if it is `signalled_rank`.
    Returns `("exit", code, checkpoints)` or `("done", state, history)`."""
    import keras

    import keras_dtensor
    from keras_dtensor.backend import launch

    # The ranks agree at every step here (by default, about every 0.1 s),
    # so the stop comes at most two steps after the signal.
    os.environ["KERAS_DTENSOR_PREEMPTION_CHECK_S"] = "0"
    world, rank = launch.world()
    model = _model(keras, kind, world)
    seen = [0]

    class Signal(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen[0] += 1
            if seen[0] == signal_at and rank == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)

    callbacks = [keras_dtensor.ShardedCheckpoint(directory), Signal()]
    x, y = _data() if data is None else data
    try:
        history = model.fit(
            x,
            y,
            epochs=EPOCHS,
            batch_size=8 if y is not None else None,
            shuffle=True,
            callbacks=callbacks,
            verbose=0,
        )
    except SystemExit as e:
        return ("exit", e.code, sorted(os.listdir(directory)))
    state = [
        keras.ops.convert_to_numpy(v)
        for v in model.weights + model.optimizer.variables
    ]
    return ("done", state, history.history)


def _interrupted_and_resumed(root, kind):
    """On every rank: an uninterrupted run, a run signalled on rank 1 (or
    0 in one process), then the same run started again."""
    import shutil

    import keras

    from keras_dtensor.backend import launch

    world, rank = launch.world()
    reference = _fit(f"{root}/reference", kind)
    keras.backend.clear_session()
    stopped = _fit(f"{root}/run", kind, SIGNAL_AT, signalled_rank=world - 1)
    if rank == 0:  # the signal's checkpoint, for a run on other processes
        shutil.copytree(f"{root}/run", f"{root}/copy")
    keras.backend.clear_session()
    resumed = _fit(f"{root}/run", kind)
    return reference, stopped, resumed


def _assert_same(reference, resumed, tolerance=0.0):
    assert reference[0] == resumed[0] == "done"
    for want, got in zip(reference[1], resumed[1], strict=True):
        if tolerance:
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=1e-6)
        else:
            np.testing.assert_array_equal(got, want)
    assert set(reference[2]) == set(resumed[2])
    for key, values in reference[2].items():
        np.testing.assert_allclose(
            resumed[2][key], values, rtol=tolerance or 0, atol=0
        )


@pytest.mark.parametrize("kind", ["dp", "mp"])
def test_sigterm_on_one_rank_saves_where_all_agree_and_resumes_exactly(
    tmp_path, kind
):
    results = run_ranks(_interrupted_and_resumed, 2, str(tmp_path), kind)
    for reference, stopped, resumed in results:
        # Every rank stopped (only rank 1 was signalled), with code 75, at
        # most two batches after the signal, mid-epoch.
        assert stopped[:2] == ("exit", 75)
        newest = int(stopped[2][-1].removeprefix("ckpt-"))
        assert SIGNAL_AT <= newest <= SIGNAL_AT + 2, stopped[2]
        assert newest % 8, "the signal's checkpoint is mid-epoch"
        _assert_same(reference, resumed)
    # The signal's checkpoint on one process (another world size and
    # mesh): the same run, within one process's rounding of 2 processes.
    (one,) = run_ranks(_fit, 1, str(tmp_path / "copy"), kind)
    _assert_same(results[0][0], one, tolerance=1e-5)


def _unpositionable(directory):
    import keras

    x, y = _data()

    def batches():
        for _ in range(EPOCHS):
            for start in range(0, 64, 8):
                yield x[start : start + 8], y[start : start + 8]

    stopped = _fit(directory, "dp", SIGNAL_AT, 0, data=(batches(), None))
    keras.backend.clear_session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(directory, "dp", data=(batches(), None))
    return stopped, resumed, [str(w.message) for w in caught]


def test_input_that_cannot_be_positioned_restarts_its_epoch(tmp_path):
    ((stopped, resumed, warned),) = run_ranks(_unpositionable, 1, str(tmp_path))
    assert stopped[:2] == ("exit", 75)
    assert resumed[0] == "done"
    assert any("cannot be read from batch" in w for w in warned), warned
    # The history still holds every epoch, those before the signal too.
    assert len(resumed[2]["loss"]) == EPOCHS


_OUTSIDE_FIT = """
import os, signal, sys
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np, keras_dtensor
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise ValueError("boom")
try:
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[
        keras_dtensor.ShardedCheckpoint(sys.argv[1]), Fail()])
except ValueError:
    pass
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("survived", flush=True)
"""


def _input(kind):
    import keras
    import torch

    x, y = _data()
    if kind == "dataloader":
        dataset = torch.utils.data.TensorDataset(
            torch.from_numpy(x), torch.from_numpy(y)
        )
        return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]

    return Batches()


def _positioned_input(root, kind):
    import keras

    reference = _fit(f"{root}/reference", "dp", data=(_input(kind), None))
    keras.backend.clear_session()
    stopped = _fit(f"{root}/run", "dp", SIGNAL_AT, 0, data=(_input(kind), None))
    keras.backend.clear_session()
    resumed = _fit(f"{root}/run", "dp", data=(_input(kind), None))
    return reference, stopped, resumed


@pytest.mark.parametrize("kind", ["dataloader", "pydataset"])
def test_dataloader_and_pydataset_resume_at_their_batch(tmp_path, kind):
    # Their shuffles draw from torch's and Python's generators.
    ((reference, stopped, resumed),) = run_ranks(
        _positioned_input, 1, str(tmp_path), kind
    )
    assert stopped[:2] == ("exit", 75)
    _assert_same(reference, resumed)


def test_a_signal_outside_fit_ends_the_process_as_before(tmp_path):
    # fit raised, so its callbacks never heard `on_train_end`: the handler
    # is still installed, and must hand the signal to the default action.
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_OUTSIDE_FIT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert "ready" in result.stdout, result.stderr[-2000:]
    assert "survived" not in result.stdout
    assert result.returncode == -signal.SIGTERM


def _complete(path):
    os.makedirs(path)
    with open(os.path.join(path, "keras_dtensor.json"), "w") as f:
        f.write("{}")


def test_a_kill_between_the_two_renames_loses_no_name(tmp_path):
    from keras_dtensor.backend import files
    from keras_dtensor.checkpoint import latest_checkpoint

    root = str(tmp_path)
    _complete(os.path.join(root, "ckpt-1"))
    target = os.path.join(root, "ckpt-2")
    _complete(target)
    staging = files.staging_path(target)
    _complete(staging)
    # What `move_into_place` does first; the kill comes before the second.
    os.replace(target, staging + ".old")
    found = latest_checkpoint(root)
    assert found == staging + ".old"  # ckpt-2, still found, still whole
    files.remove_leftovers(root)
    assert sorted(os.listdir(root)) == ["ckpt-1", "ckpt-2"]
    assert latest_checkpoint(root) == target


def test_scratch_of_a_killed_process_is_removed_by_the_next_save(tmp_path):
    from keras_dtensor.backend import files

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    time.sleep(0.1)
    left = tempfile.mkdtemp(prefix=f"keras_dtensor_save_{pid}_")
    mine = files.scratch_dir()
    files.remove_leftovers(str(tmp_path))
    assert not os.path.exists(left)
    assert os.path.exists(mine)
    os.rmdir(mine)


def _full_disk(root):
    import resource

    import keras

    import keras_dtensor
    from keras_dtensor.backend import launch

    world, rank = launch.world()
    model = _model(keras, "mp", world)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first = keras_dtensor.save_checkpoint(model, f"{root}/ckpt-1")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # this rank's disk is full: its writes fail
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        keras_dtensor.save_checkpoint(model, f"{root}/ckpt-2")
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        error = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    latest = keras_dtensor.latest_checkpoint(root)
    keras.backend.clear_session()
    fresh = _model(keras, "mp", world)
    fresh.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    keras_dtensor.load_checkpoint(fresh, latest)
    return error, latest == first, sorted(os.listdir(root))


def test_a_full_disk_during_a_sharded_save_raises_on_every_rank(tmp_path):
    for error, kept, names in run_ranks(_full_disk, 2, str(tmp_path)):
        assert error is not None and "ckpt-2" in error, error
        assert kept, "the checkpoint before is the newest complete one"
        assert names == ["ckpt-1"], names  # no staging directory left
