"""Termination signals during `fit`: noticed on any rank, acted on by all.

The handler only notes the signal; at step boundaries the ranks agree
one vote late (`Vote`), so all stop at the same boundary. A signal
outside `fit` goes to the handler that was there before.
"""

import contextlib
import signal
import threading
import time

import torch
import torch.distributed as dist
from keras.src.backend.common import global_state

from keras_dtensor import config
from keras_dtensor.backend import launch

__all__ = ["EXIT_CODE", "Signals", "Vote", "gloo_group"]

# EX_TEMPFAIL (sysexits.h): a run stopped on a signal, its checkpoint saved.
EXIT_CODE = 75
_GROUP = "keras_dtensor_preemption_group"


class Signals:
    """Notes the termination signals `signals` while `model.fit` runs."""

    def __init__(self, model, signals):
        self.model = model
        self.signals = tuple(signals)
        self.received = 0  # the first signal number (0: none yet)
        self._previous = {}

    def install(self) -> bool:
        """Installs the handlers; `False` off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return True

    def uninstall(self):
        for number, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(number, previous)
        self._previous = {}

    def _handle(self, number, frame):
        if not self.received:
            self.received = number
        inner = frame
        while inner is not None and not (
            inner.f_code.co_name == "fit"
            and inner.f_locals.get("self") is self.model
        ):
            inner = inner.f_back
        if inner is None:  # outside `fit`: the handler from before
            previous = self._previous.get(number)
            self.uninstall()
            if callable(previous):
                previous(number, frame)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(number)


def gloo_group(key):
    """A gloo group of every rank, kept in Keras's global state under
    `key`, or `None`."""
    group = global_state.get_global_attribute(key)
    if group is None and dist.is_initialized():
        group = dist.new_group(backend="gloo")
        global_state.set_global_attribute(key, group)
    return group


class Vote:
    """Whether any rank was signalled, agreed one vote late.

    Every rank calls `at_boundary` at the same boundaries with its signal
    (0: none); a signal returned means stop here. About every
    `KERAS_DTENSOR_PREEMPTION_CHECK_S` seconds each rank launches an
    all-reduce of its signal and proposed interval, and reads the last.
    """

    MAX_EVERY = 64

    def __init__(self):
        self._group = gloo_group(_GROUP) if launch.multi_process() else None
        self._pending = None
        self._every = 1  # boundaries between votes, the same on every rank
        self._count = 0
        self._last = time.monotonic()
        self._step_s = None
        self._interval_s = config.get("PREEMPTION_CHECK_S")

    def at_boundary(self, signalled: int) -> int:
        if self._group is None:
            return signalled
        now = time.monotonic()
        step, self._last = now - self._last, now
        self._step_s = (
            step if self._step_s is None else (0.8 * self._step_s + 0.2 * step)
        )
        self._count += 1
        if self._count < self._every:
            return 0
        self._count = 0
        stop = self.read()
        proposal = round(self._interval_s / max(self._step_s, 1e-6))
        proposal = min(max(proposal, 1), self.MAX_EVERY)
        flag = torch.tensor([signalled, -proposal], dtype=torch.int32)
        work = dist.all_reduce(
            flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        self._pending = (work, flag)
        return stop

    def final(self, signalled: int) -> int:
        """The last boundary: agrees now (blocking)."""
        if self._group is None:
            return signalled
        stop = self.read()
        flag = torch.tensor([signalled, 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return stop or int(flag[0])

    def read(self):
        """Waits for the vote in flight (every rank launched it); returns
        its signal (0: none)."""
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        work.wait()
        signalled, every = flag.tolist()
        self._every = -every
        return signalled
