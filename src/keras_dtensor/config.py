"""Every `KERAS_DTENSOR_*` environment variable, parsed in one place.

`get(name)` parses one when asked; `check()` parses all at `install()`,
so a bad value is an error at import naming the variable and what it
accepts (docs/guides/configuration.md).
"""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

__all__ = ["SETTINGS", "Setting", "check", "get", "settings"]


def _number(cast, strict):
    def parse(raw):
        value = cast(raw)
        if not (value > 0 if strict else value >= 0):
            raise ValueError(raw)
        return value

    return parse


_positive_float = _number(float, strict=True)
_non_negative_float = _number(float, strict=False)
_non_negative_int = _number(int, strict=False)


def _flag(raw):
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    raise ValueError


def _backend(raw):
    if not raw.strip():
        raise ValueError
    return raw.strip()


def _url(raw):
    if not raw.startswith(("file://", "tcp://", "env://")):
        raise ValueError
    return raw


@dataclasses.dataclass(frozen=True)
class Setting:
    """One variable: name without the prefix, `parse` (`ValueError` on a
    bad value), default, what it accepts and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    accepts: str
    what: str

    @property
    def env(self) -> str:
        return "KERAS_DTENSOR_" + self.name


def _flag_setting(name, default, what):
    return Setting(
        name, _flag, default, "1/0, true/false, yes/no, on/off", what
    )


SETTINGS = (
    Setting(
        "TIMEOUT",
        _positive_float,
        300.0,
        "seconds > 0",
        "timeout of the process group's collectives",
    ),
    Setting(
        "BACKEND",
        _backend,
        None,
        "a torch.distributed backend string, e.g. 'gloo'",
        "process group backend (default: gloo on CPU, "
        "'cpu:gloo,cuda:nccl' on GPUs)",
    ),
    Setting(
        "INIT_METHOD",
        _url,
        None,
        "a 'file://', 'tcp://' or 'env://' URL",
        "rendezvous URL instead of torchrun's MASTER_ADDR/MASTER_PORT",
    ),
    Setting(
        "SAVE_TIMEOUT",
        _positive_float,
        60.0,
        "seconds > 0",
        "how long a save waits for every rank to join it",
    ),
    Setting(
        "PREEMPTION_CHECK_S",
        _non_negative_float,
        0.1,
        "seconds >= 0",
        "how often the ranks agree on a termination signal (0: every step)",
    ),
    Setting(
        "SAVE_PIECE_MB",
        _positive_float,
        16.0,
        "MiB > 0",
        "a saved sharded variable reaches rank 0 in pieces of this size",
    ),
    _flag_setting(
        "LOG_ALL_RANKS",
        False,
        "print Keras's progress and messages on every rank, not only 0",
    ),
    Setting(
        "BUCKET_MB",
        _positive_float,
        25.0,
        "MiB > 0",
        "gradient all-reduce bucket size (DDP's bucket_cap_mb)",
    ),
    Setting(
        "CHECK_EVERY",
        _non_negative_int,
        10,
        "an integer >= 0 (0: first batch of each epoch only)",
        "compare the global batch's checksum across ranks every N batches",
    ),
    _flag_setting(
        "SHARDED_LOADING",
        True,
        "a DataLoader or PyDataset loads only this process's rows of each "
        "global batch (0: the whole batch)",
    ),
    _flag_setting(
        "LOCAL_BATCH",
        True,
        "ModelParallel: FSDP-style models run on each rank's rows as plain "
        "tensors, their weights gathered block by block",
    ),
    _flag_setting(
        "LOCAL_MODEL",
        True,
        "ModelParallel, weights sharded over a non-batch axis: only the "
        "layers owning them run as DTensors, the ops between them on local "
        "tensors (torch's tensor parallelism), once a first call per input "
        "signature has matched the DTensor run (needs LOCAL_BATCH)",
    ),
    Setting(
        "GATHER_MB",
        _positive_float,
        25.0,
        "MiB > 0",
        "FSDP-style layouts: weights are gathered in blocks of consecutive "
        "layers of at least this size",
    ),
    _flag_setting(
        "JIT",
        True,
        "ModelParallel: jit_compile=True compiles the forward (off: eager)",
    ),
    _flag_setting(
        "SYNC_BATCH_NORM",
        True,
        "DataParallel: BatchNormalization uses the global batch's "
        "statistics (off: each process's own, as DDP)",
    ),
    _flag_setting(
        "SPLIT_UPDATE",
        True,
        "DataParallel: split the optimizer update by variable inside fit",
    ),
    Setting(
        "SPLIT_UPDATE_MB",
        _non_negative_float,
        4.0,
        "MiB >= 0",
        "DataParallel: split the update only from this many trainable "
        "weight MiB on (0: always)",
    ),
)

_BY_NAME = {v.name: v for v in SETTINGS}


def _parse(variable):
    raw = os.environ.get(variable.env)
    if raw is None:
        return variable.default
    try:
        return variable.parse(raw)
    except ValueError:
        raise ValueError(
            f"{variable.env}={raw!r} is not valid: expected "
            f"{variable.accepts} ({variable.what})."
        ) from None


def get(name):
    """The parsed value of `KERAS_DTENSOR_<name>`, or its default."""
    return _parse(_BY_NAME[name])


def check():
    """Parses every variable; raises on the first bad value."""
    for variable in SETTINGS:
        _parse(variable)


def settings():
    """`(env name, current value, default, what)` for every variable."""
    return [(v.env, os.environ.get(v.env), v.default, v.what) for v in SETTINGS]
