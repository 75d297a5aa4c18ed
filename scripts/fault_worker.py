"""One training job for `scripts/fault_matrix.py`, launched by torchrun.

Environment: `ROOT` (a fresh directory), `STRATEGY` (`model_parallel` or
`data_parallel`), `KILL_RANK` (optional: that rank SIGKILLs itself in the
middle of epoch 3 on the first attempt), `CALLBACKS` (`keras`: five Keras
callbacks with BackupAndRestore; `sharded`: `ShardedCheckpoint` every
epoch, keep 2), `KILL_AFTER` (with `sharded`: the kill comes that many
seconds after `fit` starts instead, at any moment, during a save or not).
`CALLBACKS=preempt`: `ShardedCheckpoint` every 4 batches, shuffled data,
and `FAULT` one of `sigterm` (sent from outside), `sigkill_save` (rank 1
SIGKILLs itself inside save number `SAVE_INDEX`, `WHEN` before or after
writing its shards), `stall` (rank 1 sleeps `STALL_S` every 5 batches),
`full_disk` (rank 1's writes fail inside save `SAVE_INDEX`). Rank 0 logs
each step's start and each save to `ROOT/events.txt`.
Every rank passes the same callback arguments, as a one-process script
would. Rank 0 writes the final weights to `ROOT/final.npz`.
"""

import os
import resource
import signal
import sys
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

import keras_dtensor  # noqa: E402
from keras_dtensor.checkpoint import api  # noqa: E402

ROOT = os.environ["ROOT"]
world = len(keras.distribution.list_devices())
if os.environ["STRATEGY"] == "model_parallel":
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
else:
    distribution = keras.distribution.DataParallel()
keras.distribution.set_distribution(distribution)

keras.utils.set_random_seed(5)
model = keras.Sequential(
    [
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(1),
    ]
)
model.compile(optimizer="adam", loss="mse", metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 16)).astype("float32")
y = rng.normal(size=(128, 1)).astype("float32")


class KillMidEpoch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        kill_rank = os.environ.get("KILL_RANK")
        if (
            first_attempt
            and kill_rank is not None
            and dist.get_rank() == int(kill_rank)
            and self._epoch == 2
            and batch == 5
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


class KillAfter(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and dist.get_rank() == int(os.environ["KILL_RANK"]):
            delay = float(os.environ["KILL_AFTER"])
            kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            threading.Timer(delay, kill).start()


sharded = [
    keras_dtensor.ShardedCheckpoint(os.path.join(ROOT, "sharded"), keep=2),
]
if os.environ.get("KILL_AFTER") and os.environ.get("KILL_RANK"):
    sharded.append(KillAfter())
keras_callbacks = [
    keras.callbacks.BackupAndRestore(os.path.join(ROOT, "backup")),
    keras.callbacks.ModelCheckpoint(
        os.path.join(ROOT, "ckpt", "w-{epoch}.weights.h5"),
        save_weights_only=True,
    ),
    keras.callbacks.ModelCheckpoint(
        os.path.join(ROOT, "best", "best.keras"),
        monitor="loss",
        save_best_only=True,
    ),
    keras.callbacks.CSVLogger(os.path.join(ROOT, "log.csv"), append=True),
    keras.callbacks.TensorBoard(os.path.join(ROOT, "tb")),
    KillMidEpoch(),
]
FAULT = os.environ.get("FAULT", "")
FIRST = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
RANK = dist.get_rank()


def _log(line):
    if RANK == 0:
        with open(os.path.join(ROOT, "events.txt"), "a") as f:
            f.write(f"{line} {time.time():.4f}\n")


class Events(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        done = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        _log(f"step {done}")
        if FAULT == "stall" and RANK == 1 and done % 5 == 4:
            time.sleep(float(os.environ["STALL_S"]))


def _faulty(original, counter=[0]):  # noqa: B006 - one counter a process
    def save(*args, **kwargs):
        counter[0] += 1
        chosen = (
            FIRST
            and RANK == 1
            and counter[0] == int(os.environ.get("SAVE_INDEX", "0"))
        )
        if (
            chosen
            and FAULT == "sigkill_save"
            and os.environ["WHEN"] == "before"
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        if chosen and FAULT == "full_disk":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
            try:
                return original(*args, **kwargs)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        result = original(*args, **kwargs)
        if chosen and FAULT == "sigkill_save":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return save


def _timed(original):
    def save_checkpoint(*args, **kwargs):
        _log("save_start")
        try:
            return original(*args, **kwargs)
        finally:
            _log("save_end")

    return save_checkpoint


if os.environ.get("CALLBACKS") == "preempt":
    api.save_checkpoint = _timed(api.save_checkpoint)
    api.dcp.save = _faulty(api.dcp.save)
preempt = [
    keras_dtensor.ShardedCheckpoint(
        os.path.join(ROOT, "sharded"), save_freq=4, keep=2
    ),
    Events(),
]
callbacks = {"keras": keras_callbacks, "sharded": sharded, "preempt": preempt}[
    os.environ.get("CALLBACKS", "keras")
]
start = time.monotonic()
try:
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=4,
        shuffle=os.environ.get("CALLBACKS") == "preempt",
        verbose=0,
        callbacks=callbacks,
    )
except SystemExit as e:
    with open(os.path.join(ROOT, f"exit-{RANK}.txt"), "w") as f:
        f.write(str(e.code))
    raise
except RuntimeError as e:
    if FAULT != "full_disk":
        raise
    # Raised on every rank; the checkpoint before must still load.
    with open(os.path.join(ROOT, f"raised-{RANK}.txt"), "w") as f:
        f.write(str(e))
    api.load_checkpoint(
        model, api.latest_checkpoint(os.path.join(ROOT, "sharded"))
    )
    with open(os.path.join(ROOT, f"intact-{RANK}.txt"), "w") as f:
        f.write("ok")
    sys.exit(0)
seconds = time.monotonic() - start
weights = model.get_weights()
if dist.get_rank() == 0:
    np.savez(os.path.join(ROOT, "final.npz"), *weights)
    with open(os.path.join(ROOT, "fit_seconds.txt"), "w") as f:
        f.write(f"{seconds:.3f}")
