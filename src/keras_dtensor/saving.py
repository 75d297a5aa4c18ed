"""Saving under a distribution: every rank gathers, rank 0 writes, atomically.

Keras's `save_weights` and `model.save` convert every variable to numpy;
for a sharded variable that is an all-gather, so every rank must run the
save, in the same order. Each rank runs Keras's own writer; rank 0 writes
next to the target and renames into place (a reader never sees half a
file), the other ranks write to a private scratch directory that is then
deleted (all ranks writing one `.weights.h5` would also collide on h5py's
file lock). Files are ordinary Keras files: plain single-process Keras
loads them.

A save called on some ranks only would hang in the first gather; a
monitored barrier first turns that into an error naming the missing ranks.
A file rank 0 cannot create (missing directory, no permission) is found
before any gather, and the outcome of the write is shared at the end: every
rank raises the same error instead of the others waiting for the
collective timeout.
"""

import datetime
import os
import shutil
import tempfile
import uuid

import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor import data_parallel
from keras_dtensor.launch import multi_process

__all__ = ["wrap_save"]


def _check_all_ranks_save(what, filepath):
    timeout = config.get("SAVE_TIMEOUT")
    try:
        dist.monitored_barrier(
            timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"{what}({str(filepath)!r}) must be called on every rank: it "
            "gathers sharded variables, a collective. Rank "
            f"{dist.get_rank()} of {dist.get_world_size()} waited {timeout:g}"
            " s for the others (KERAS_DTENSOR_SAVE_TIMEOUT sets this). "
            f"Call it on all ranks; only rank 0 writes the file. Details: {e}"
        ) from None


def _share_failure(problem):
    """Every rank's failure (or `None`), as `[(rank, message), ...]`."""
    failures = [None] * dist.get_world_size()
    mine = None if problem is None else f"{type(problem).__name__}: {problem}"
    dist.all_gather_object(failures, mine)
    return [(rank, m) for rank, m in enumerate(failures) if m is not None]


def _raise_if_failed(failures, what, filepath, own=None):
    if not failures:
        return
    if own is not None:
        raise own
    rank, message = failures[0]
    raise RuntimeError(
        f"{what}({filepath!r}) failed on rank {rank} of "
        f"{dist.get_world_size()}: {message}"
    )


def wrap_save(original, what):
    """Wraps a Keras writer `original(model, filepath, ...)`.

    Args:
        original: `saving_lib.save_model` or `saving_lib.save_weights_only`.
        what: the user-facing name, for error messages.

    Returns:
        The wrapper.
    """

    def _save(model, filepath, *args, **kwargs):
        if not multi_process() or not isinstance(filepath, (str, os.PathLike)):
            return original(model, filepath, *args, **kwargs)
        _check_all_ranks_save(what, filepath)
        # DataParallel leaves some optimizer slots stale on non-owners.
        data_parallel.sync_optimizer_state(model)
        final = os.fspath(filepath)
        name = os.path.basename(final)  # Keras checks the file suffix
        if dist.get_rank() == 0:
            scratch = None
            target = os.path.join(
                os.path.dirname(final) or ".", f".{uuid.uuid4().hex}.{name}"
            )
        else:
            scratch = tempfile.mkdtemp(prefix="keras_dtensor_save_")
            target = os.path.join(scratch, name)
        problem = None
        if scratch is None:
            probe = f"{target}.probe"
            try:  # can rank 0 write there at all?
                open(probe, "wb").close()
                os.remove(probe)
            except OSError as e:
                problem = e
        _raise_if_failed(_share_failure(problem), what, final)
        try:
            result = original(model, target, *args, **kwargs)
            if scratch is None:
                os.replace(target, final)
        except Exception as e:
            problem = e
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            elif os.path.exists(target):
                os.remove(target)
        # Nobody returns before the file is in place, so any rank may load.
        _raise_if_failed(_share_failure(problem), what, final, problem)
        return result

    return _save
