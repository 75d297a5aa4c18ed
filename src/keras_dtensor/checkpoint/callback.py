"""`ShardedCheckpoint`: sharded checkpoints from `fit`, with resume.

The same arguments on every process, as any Keras callback. It saves with
`api.save_checkpoint` (every rank writes its shards) into
`<directory>/ckpt-<batches>` (batches trained so far, zero-padded, so the
names sort), keeps the newest `keep`, and when `fit` starts it loads the
newest complete checkpoint and resumes at its epoch, as Keras's
`BackupAndRestore` does: a job killed at any moment and started again
(`torchrun --max-restarts`, or by hand) continues from the last commit.
With `save_freq="epoch"` the resumed run equals an uninterrupted one; a
checkpoint from the middle of an epoch restarts that epoch from its first
batch with the weights it holds (Keras's `BackupAndRestore` semantics).
"""

import os
import shutil

import keras

from keras_dtensor.backend import launch
from keras_dtensor.checkpoint import api

__all__ = ["ShardedCheckpoint"]

_PREFIX = "ckpt-"


class ShardedCheckpoint(keras.callbacks.Callback):
    """Saves sharded checkpoints during `fit` and resumes from the newest.

    Args:
        directory: the folder of checkpoints, on a filesystem every
            process sees.
        save_freq: `"epoch"`, or a number of batches.
        keep: how many complete checkpoints to keep (the newest).
        async_save: write in the background; each save is committed when
            the next one starts, and the last when `fit` ends.
        resume: load the newest checkpoint when `fit` starts.

    Example:
    >>> model.fit(x, y, epochs=10, callbacks=[
    ...     keras_dtensor.ShardedCheckpoint("ckpt", keep=2)])
    """

    def __init__(
        self,
        directory,
        save_freq="epoch",
        keep=3,
        async_save=False,
        resume=True,
    ):
        super().__init__()
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                "save_freq must be 'epoch' or a positive number of batches. "
                f"Received: save_freq={save_freq!r}"
            )
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be at least 1. Received: keep={keep}")
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.keep = keep
        self.async_save = async_save
        self.resume = resume
        self._batches = 0
        self._epoch = 0
        self._epoch_start = 0  # batches trained when this epoch began
        self._pending = None

    def on_train_begin(self, logs=None):
        self._batches, self._epoch = 0, 0
        if not self.resume:
            return
        latest = api.latest_checkpoint(self.directory, _PREFIX)
        # Rank 0's view decides, so every rank loads the same one.
        latest = launch.broadcast_bytes((latest or "").encode()).decode()
        if not latest:
            return
        manifest = api.load_checkpoint(self.model, latest)
        extra = manifest.get("extra") or {}
        # fit resumes at the start of `epoch`: count batches from there.
        self._batches = int(extra.get("resume_batches", 0))
        self._epoch = int(extra.get("epoch", 0))
        self.model._initial_epoch = self._epoch

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = self._batches

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.save_freq != "epoch" and self._batches % self.save_freq == 0:
            # As BackupAndRestore: fit resumes at this epoch's start.
            self._save(epoch=self._epoch, resume_batches=self._epoch_start)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch=epoch + 1, resume_batches=self._batches)

    def on_train_end(self, logs=None):
        self._finish()

    def _save(self, epoch, resume_batches):
        self._finish()
        path = os.path.join(self.directory, f"{_PREFIX}{self._batches:010d}")
        extra = {
            "epoch": epoch,
            "batches": self._batches,
            "resume_batches": resume_batches,
        }
        result = api.save_checkpoint(
            self.model, path, async_save=self.async_save, extra=extra
        )
        if self.async_save:
            self._pending = result
        else:
            self._prune()

    def _finish(self):
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            self._prune()

    def _prune(self):
        if launch.world()[1] != 0:
            return
        complete = sorted(
            name
            for name in os.listdir(self.directory)
            if name.startswith(_PREFIX)
            and os.path.exists(os.path.join(self.directory, name, api.MANIFEST))
        )
        for name in complete[: -self.keep]:
            shutil.rmtree(
                os.path.join(self.directory, name), ignore_errors=True
            )
