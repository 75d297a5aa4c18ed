"""`ShardedCheckpoint`: sharded checkpoints from `fit`, with resume.

A checkpoint resumes at its exact batch where the input can be positioned
(random and metric states in its manifest), otherwise at its epoch's
first batch, as Keras's `BackupAndRestore` does.
"""

import base64
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import sys
import time
import warnings

import keras
import numpy as np
import torch

from keras_dtensor.backend import context
from keras_dtensor.backend import launch
from keras_dtensor.backend import resume
from keras_dtensor.checkpoint import api
from keras_dtensor.checkpoint import manifest
from keras_dtensor.checkpoint import preemption

__all__ = ["ShardedCheckpoint"]

_PREFIX = "ckpt-"  # then the batches trained, zero-padded: the names sort


def _random_state():
    """This process's global random generators, as JSON."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    torch_state = torch.get_rng_state().numpy().tobytes()
    return {
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "python": [version, list(internal), gauss_next],
        "torch": base64.b64encode(torch_state).decode(),
    }


def _own(position):
    world, rank = launch.world()
    same = position["processes"] == world
    return position["ranks"][rank if same else 0], same


def _set_random_state(position, which):
    """Sets the global generators as at `"begin"` or `"moment"`."""
    state = _own(position)[0][which]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    raw = bytearray(base64.b64decode(state["torch"]))
    torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())


def _restore_metrics(model, position):
    """Puts the epoch's metric states back (after Keras reset them)."""
    variables = model.metrics_variables
    share, same = _own(position)
    partial_now = context.is_data_parallel()
    if same and partial_now == position["partial_metrics"]:
        values = share["metrics"]
    else:
        per_rank = [r["metrics"] for r in position["ranks"]]
        if position["partial_metrics"]:  # the global state is their sum
            values = [
                np.sum([np.asarray(r[i]) for r in per_rank], axis=0)
                for i in range(len(variables))
            ]
        else:
            values = per_rank[0]
        if partial_now and launch.world()[1] != 0:
            values = [np.zeros_like(np.asarray(v)) for v in values]
    if len(values) != len(variables):
        return  # another model's metrics: the epoch's logs start afresh
    for variable, value in zip(variables, values, strict=True):
        variable.assign(np.asarray(value, dtype=variable.dtype))


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
        on_preemption: on a termination signal, save where all ranks
            agree to stop and exit with code 75
            (`keras_dtensor.PREEMPTED_EXIT_CODE`).
        signals: the signals that mean "this machine is going away".

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
        on_preemption=True,
        signals=(signal.SIGTERM, signal.SIGUSR1),
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
        self.on_preemption = on_preemption
        self.signals = tuple(signals)
        self._pending = self._signals = self._vote = None

    def on_train_begin(self, logs=None):
        self._batches, self._epoch, self._saved_at = 0, 0, -1
        self._epoch_start = 0  # batches trained when this epoch began
        self._begin_state = None  # random state when this epoch began
        self._history = {"epoch": [], "logs": {}}  # resumed epochs too
        self._resumed_epochs = 0
        self._position = None  # where the resumed epoch continues
        if self.on_preemption:  # before loading: a signal then is saved too
            self._signals = preemption.Signals(self.model, self.signals)
            if not self._signals.install():
                warnings.warn(
                    "ShardedCheckpoint: fit is not running in the main "
                    "thread, where Python handles signals: a termination "
                    "signal will not be saved from.",
                    stacklevel=2,
                )
        if self.resume:
            self._load_latest()
        if self.on_preemption:
            self._vote = preemption.Vote()

    def _load_latest(self):
        latest = api.latest_checkpoint(self.directory, _PREFIX)
        # Rank 0's view decides, so every rank loads the same one.
        latest = launch.broadcast_bytes((latest or "").encode()).decode()
        if not latest:
            return
        extra = api.load_checkpoint(self.model, latest).get("extra") or {}
        # fit resumes at the start of `epoch`: count batches from there.
        self._batches = int(extra.get("resume_batches", 0))
        self._saved_at = int(extra.get("batches", -1))
        self._epoch = int(extra.get("epoch", 0))
        self.model._initial_epoch = self._epoch
        self._history.update(extra.get("history") or {})
        self._resumed_epochs = len(self._history["epoch"])
        # At an epoch's start (no position): its shuffle all the same.
        self._position = extra.get("position") or {"batches": 0}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = self._batches
        resumed, self._position = self._position, None
        if resumed:
            done = None
            if resumed["batches"]:
                _set_random_state(resumed, "begin")
                done = functools.partial(self._resumed, resumed)
            resume.request(resumed["batches"], done, self._resumed_epochs)
        self._begin_state = _random_state()

    def _resumed(self, resumed, positioned, kind):
        if positioned:
            _restore_metrics(self.model, resumed)
            _set_random_state(resumed, "moment")
            self._batches = self._epoch_start + resumed["batches"]
        elif launch.world()[1] == 0:
            warnings.warn(
                f"ShardedCheckpoint: the input ({kind}) cannot be read "
                f"from batch {resumed['batches']} of epoch {self._epoch + 1}"
                " again; the epoch restarts from its first batch with the "
                "checkpoint's weights.",
                stacklevel=2,
            )

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        in_epoch = self._batches - self._epoch_start
        if self.save_freq != "epoch" and self._batches % self.save_freq == 0:
            self._save_here(in_epoch)
        self._at_boundary(in_epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._history["epoch"].append(epoch)
        for key, value in (logs or {}).items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                value = str(value)
            self._history["logs"].setdefault(key, []).append(value)
        if self.save_freq == "epoch":
            self._save_here(0, epoch=epoch + 1)
        self._at_boundary(0, epoch=epoch + 1)

    def _at_boundary(self, in_epoch, epoch=None):
        agreed = self._vote and self._vote.at_boundary(self._signals.received)
        if agreed:
            self._preempted(agreed, in_epoch, epoch=epoch)

    def on_train_end(self, logs=None):
        try:
            agreed = self._vote and self._vote.final(self._signals.received)
            if agreed:
                self._preempted(agreed, 0, epoch=self._epoch + 1)
            self._finish()
        finally:
            self._stop_listening()
        history = getattr(self.model, "history", None)
        if self._resumed_epochs and isinstance(
            history, keras.callbacks.History
        ):
            history.epoch = list(self._history["epoch"])  # resumed ones too
            logs = self._history["logs"].items()
            history.history = {k: list(v) for k, v in logs}

    def _stop_listening(self):
        if self._signals is not None:
            self._signals.uninstall()
        self._signals = self._vote = None

    def _preempted(self, number, in_epoch, epoch=None):
        """Every rank is here: save this step (if not yet) and exit; a
        second signal during the save is only noted."""
        started = time.monotonic()
        vote, self._vote = self._vote, None
        vote.read()  # every rank launched it
        self._finish()
        if self._saved_at != self._batches:
            self._save_here(in_epoch, epoch=epoch, force_sync=True)
        self._stop_listening()
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        if launch.world()[1] == 0:
            print(
                f"keras_dtensor: {name} on some rank; all ranks stopped after "
                f"batch {self._batches} (epoch {self._epoch + 1}), checkpoint "
                f"in {self.directory!r} ({time.monotonic() - started:.2f} s); "
                f"exiting with code {preemption.EXIT_CODE}.",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(preemption.EXIT_CODE)

    def _save_here(self, in_epoch, epoch=None, force_sync=False):
        """A checkpoint after `in_epoch` batches of this epoch, or at its
        end (`epoch`: the next one)."""
        extra = {
            "epoch": self._epoch if epoch is None else epoch,
            "resume_batches": self._epoch_start if in_epoch else self._batches,
            "batches": self._batches,
            "history": self._history,
        }
        if in_epoch:  # this rank's generators and metrics, every rank's
            mine = {
                "begin": self._begin_state,
                "moment": _random_state(),
                "metrics": [
                    np.asarray(keras.ops.convert_to_numpy(v)).tolist()
                    for v in self.model.metrics_variables
                ],
            }
            shares = launch.all_gather_bytes(json.dumps(mine).encode())
            extra["position"] = {
                "batches": in_epoch,
                "processes": launch.world()[0],
                "partial_metrics": context.is_data_parallel(),
                "ranks": [json.loads(share) for share in shares],
            }
        self._finish()
        path = os.path.join(self.directory, f"{_PREFIX}{self._batches:010d}")
        async_save = self.async_save and not force_sync
        result = api.save_checkpoint(
            self.model, path, async_save=async_save, extra=extra
        )
        self._saved_at = self._batches
        if async_save:
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
        for path in api.checkpoints(self.directory, _PREFIX)[: -self.keep]:
            # The manifest first: a kill while the rest goes leaves an
            # incomplete checkpoint, never one that looks complete.
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, manifest.MANIFEST))
            shutil.rmtree(path, ignore_errors=True)
