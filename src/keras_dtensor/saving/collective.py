"""Saving under a distribution: rank 0 writes, from every rank's shards.

Every rank runs Keras's writer; rank 0's file is staged and renamed into
place. The ranks meet first and share the outcome, so every rank raises
the same error (`docs/internals/saving.md`).
"""

import functools
import os
import shutil

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras_dtensor import data_parallel
from keras_dtensor.backend import consensus
from keras_dtensor.backend import context
from keras_dtensor.backend import files
from keras_dtensor.backend import launch
from keras_dtensor.backend.launch import multi_process
from keras_dtensor.saving import h5_stream
from keras_dtensor.saving import zip_writer

__all__ = ["RankZeroFile", "wrap_save", "wrap_save_model_to_fileobj"]


def _move_contents(staging, name, directory):
    """`staging`'s files into `directory`, the target and `.json` last."""
    entries = os.listdir(staging)
    last = [e for e in entries if e == name or e.endswith(".json")]
    for entry in sorted(set(entries) - set(last)) + sorted(last):
        files.move_into_place(
            os.path.join(staging, entry), os.path.join(directory, entry)
        )


def _share_failure(problem):
    """Every rank's failure (or `None`), as `[(rank, message), ...]`."""
    mine = None if problem is None else f"{type(problem).__name__}: {problem}"
    return consensus.failures(mine)


class _PeerFailed(Exception):  # noqa: N818 (a signal, not an error)
    """Another rank failed; its error is raised on every rank."""


def _write_alone(original, model, filepath, *args, **kwargs):
    """Keras's writer on this rank alone, staged and renamed into place."""
    directory, name = files.split(filepath)
    staging = files.staging_path(filepath)
    try:
        os.mkdir(staging)
    except OSError:  # Keras's own error for the target
        return original(model, filepath, *args, **kwargs)
    try:
        result = original(model, os.path.join(staging, name), *args, **kwargs)
        _move_contents(staging, name, directory)
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class RankZeroFile:
    """`filepath`, written by every rank, rank 0's kept: `finish` moves it
    into place or raises on every rank, naming the call `what`."""

    def __init__(self, what, filepath):
        self.what, self.final = what, os.fspath(filepath)
        launch.every_rank_joins(
            f"{what}({self.final!r})",
            "every rank takes part (sharded variables travel to rank 0 in "
            "pieces, and the ranks agree on the outcome); call it on all "
            "ranks, only rank 0 writes the file",
        )
        self.directory, self.name = files.split(self.final)
        self.rank_0 = dist.get_rank() == 0
        if self.rank_0:
            files.remove_leftovers(self.directory, self.name)
            self.staging = files.staging_path(self.final)
        else:
            files.remove_dead_scratch()
            self.staging = files.scratch_dir()
        self.target = os.path.join(self.staging, self.name)  # same suffix
        problem = None
        if self.rank_0:
            try:  # can rank 0 write there at all?
                os.mkdir(self.staging)
                open(self.target, "wb").close()
                os.remove(self.target)
            except OSError as e:
                problem = e
        self.check(problem, raise_own=False)  # rank 0's error, everywhere

    def check(self, problem, raise_own=True):
        """Raises on every rank if any failed; a collective."""
        if failures := _share_failure(problem):
            self.discard()
            if raise_own and problem is not None:
                raise problem
            rank, message = failures[0]
            raise RuntimeError(
                f"{self.what}({self.final!r}) failed on rank {rank} of "
                f"{dist.get_world_size()}: {message}"
            )

    def discard(self):
        """Removes what this rank wrote (idempotent)."""
        shutil.rmtree(self.staging, ignore_errors=True)

    def finish(self, problem=None):
        """Rank 0's file into place, or the first failure on every rank."""
        try:
            if problem is None and self.rank_0:
                _move_contents(self.staging, self.name, self.directory)
        except Exception as e:
            problem = e
        finally:
            self.discard()
        self.check(problem)  # none returns before the file is in place


def _write_on_rank_0(original, what, model, filepath, *args, **kwargs):
    written = RankZeroFile(what, filepath)
    # DataParallel leaves some optimizer slots stale on non-owners.
    data_parallel.sync_optimizer_state(model)
    result = problem = None
    try:
        with h5_stream.scope() as streamed:
            try:
                result = original(model, written.target, *args, **kwargs)
            except _PeerFailed:
                pass  # the failing rank's error is shared below
            except Exception as e:
                problem = e
        # A failed write causes any later error (h5py's close).
        problem = streamed.error or problem
    except Exception as e:
        problem = e
    written.finish(problem)
    return result


def _is_collective(model):
    """Whether saving `model` needs every rank."""
    if context.current() is not None or data_parallel.has_stale_state(model):
        return True
    variables = list(getattr(model, "variables", ()))
    optimizer = getattr(model, "optimizer", None)
    variables += list(getattr(optimizer, "variables", ()))
    return any(isinstance(v.value, DTensor) for v in variables)


def wrap_save(original, what):
    """Wraps `saving_lib.save_model` or `save_weights_only`; `what` names
    the user-facing call in messages."""

    def _save(model, filepath, *args, **kwargs):
        if not multi_process() or not isinstance(filepath, (str, os.PathLike)):
            return original(model, filepath, *args, **kwargs)
        if not _is_collective(model):
            return _write_alone(original, model, filepath, *args, **kwargs)
        # Every rank writes its own target, not callbacks' shared files.
        with consensus.files_shared(False):
            return _write_on_rank_0(
                original, what, model, filepath, *args, **kwargs
            )

    return _save


def _save_archive(model, fileobj):
    """The `.keras` zip, as Keras writes it, but the weights in place."""
    # Keras's internals load after `install()` checked the environment.
    from keras.src.saving import saving_lib

    config_json, metadata_json = saving_lib._serialize_model_as_json(model)
    with zip_writer.StoredZip(fileobj) as archive:
        problem = None
        try:
            archive.writestr(
                saving_lib._METADATA_FILENAME, metadata_json.encode()
            )
            archive.writestr(saving_lib._CONFIG_FILENAME, config_json.encode())
        except OSError as e:
            problem = e
        # The ranks are about to send rank 0 their shards: a rank 0 that
        # could not write the first members would never receive them.
        failures = _share_failure(problem)
        if problem is not None:
            raise problem
        if failures:
            raise _PeerFailed(failures)
        assets = saving_lib.DiskIOStore(
            saving_lib._ASSETS_DIRNAME, archive=archive, mode="w"
        )
        try:
            with archive.member(saving_lib._VARS_FNAME_H5) as window:
                weights = saving_lib.H5IOStore(window, mode="w")
                try:
                    saving_lib._save_state(
                        model,
                        weights_store=weights,
                        assets_store=assets,
                        inner_path="",
                        visited_saveables=set(),
                    )
                finally:
                    weights.close()
        except BaseException:
            assets.archive = None  # only its temporary directory goes
            raise
        finally:
            assets.close()  # the assets follow the weights


def wrap_save_model_to_fileobj(original):
    """Wraps `saving_lib._save_model_to_fileobj(model, fileobj[, format])`:
    inside a save, into a file on disk, `_save_archive`."""

    @functools.wraps(original)
    def _save_model_to_fileobj(model, fileobj, *weights_format):
        if (
            h5_stream.current() is not None
            and tuple(weights_format) in ((), ("h5",))
            and isinstance(getattr(fileobj, "name", None), str)
        ):
            return _save_archive(model, fileobj)
        return original(model, fileobj, *weights_format)

    return _save_model_to_fileobj
