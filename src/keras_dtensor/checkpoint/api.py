"""Sharded checkpoints on `torch.distributed.checkpoint` (DCP).

Every rank writes its own shards; any number of processes, under any
layout, reads them back. A save is staged, its manifest written last,
then renamed into place; a load checks every file first. Every function
here is collective (`docs/internals/saving.md`).
"""

import functools
import json
import os
import shutil
import uuid

import torch
import torch.distributed.checkpoint as dcp
from keras.src.backend.common import global_state

from keras_dtensor import data_parallel
from keras_dtensor.backend import consensus
from keras_dtensor.backend import files
from keras_dtensor.backend import launch
from keras_dtensor.checkpoint import manifest
from keras_dtensor.checkpoint import preemption
from keras_dtensor.checkpoint import reader
from keras_dtensor.checkpoint import writer

__all__ = [
    "PendingCheckpoint",
    "export_weights",
    "import_weights",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]


def _value(variable):
    value = variable.value
    return value.detach() if isinstance(value, torch.nn.Parameter) else value


def _keyed(prefix, variables, out, drop_first=False):
    seen = {}
    for variable in variables:
        path = variable.path
        if drop_first:  # the optimizer's own name: "adam", or "adam_1"
            path = path.partition("/")[2] or path
        key = f"{prefix}/{path}"
        count = seen.get(key, 0)
        seen[key] = count + 1
        out[key if count == 0 else f"{key}#{count}"] = _value(variable)


def _state_dict(model):
    """The tensors to save or load into, by key (views of the variables)."""
    data_parallel.sync_optimizer_state(model)  # DataParallel's stale slots
    state = {}
    _keyed("model", model.variables, state)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        _keyed("optimizer", optimizer.variables, state, drop_first=True)
    generator = global_state.get_global_attribute("global_seed_generator")
    if generator is not None:
        state["rng/keras"] = _value(generator.state)
    state[f"rng/torch/{launch.world()[1]}"] = torch.get_rng_state()
    return state


def _commit(final, staging, write, state, extra, storage_writer):
    """Runs `write()`, then the manifest, then moves the checkpoint into
    place; a failure on any rank raises on every rank."""
    world, rank = launch.world()
    problem = None
    try:
        write()
    except dcp.CheckpointException as e:  # each rank's error, no traceback
        problem = "; ".join(
            f"rank {r}: {type(exc).__name__}: {exc}"
            for r, (exc, _) in sorted(e.failures.items())
        )
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    problem = consensus.first_failure(problem)
    if problem:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(
            f"Checkpoint {final!r} was not written ({problem}); the "
            "checkpoints written before it are intact."
        )
    written = sorted(os.listdir(staging))
    hashes = manifest.gathered_hashes(staging, written, storage_writer.digests)
    if rank == 0:
        contents = {
            "format": manifest.FORMAT,
            "digest": manifest.DIGEST,
            "processes": world,
            "extra": extra,
            "files": hashes,
            "keys": {
                k: [list(t.shape), str(t.dtype).removeprefix("torch.")]
                for k, t in state.items()
                if not k.startswith("rng/torch/")
            },
        }
        try:
            path = os.path.join(staging, manifest.MANIFEST)
            with open(path, "w") as f:
                json.dump(contents, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            files.move_into_place(staging, final)
        except OSError as e:
            problem = e
    problem = consensus.first_failure(problem)
    if problem:
        raise RuntimeError(f"Checkpoint {final!r} was not committed: {problem}")
    return final


class PendingCheckpoint:
    """A checkpoint being written in the background (`async_save=True`);
    `result()`, on every rank, commits it and returns its path."""

    def __init__(self, commit):
        self._commit, self._path = commit, None

    def result(self):
        if self._path is None:
            self._path, self._commit = self._commit(), None
        return self._path


def save_checkpoint(model, directory, async_save=False, extra=None):
    """Saves `model`'s variables and optimizer state as a DCP checkpoint.

    Every rank writes its own shards; the checkpoint appears at
    `directory` only once complete, replacing any there.

    Args:
        model: a built Keras model (its optimizer is built if needed).
        directory: where the checkpoint goes (a directory).
        async_save: return once the state is staged in memory; then call
            `.result()` (on every rank) to commit.
        extra: a JSON-serializable dict kept in the manifest (rank 0's).

    Returns:
        The checkpoint's absolute path, or a `PendingCheckpoint`.

    Example:
    >>> path = keras_dtensor.save_checkpoint(model, "ckpt/epoch-3")
    """
    launch.every_rank_joins(
        f"save_checkpoint({os.fspath(directory)!r})",
        "every rank writes its shards",
    )
    rank = launch.world()[1]
    final = os.path.abspath(os.fspath(directory))
    token = launch.broadcast_bytes(uuid.uuid4().hex.encode()).decode()
    staging = files.staging_path(final, token)  # rank 0's name
    parent, _ = files.split(final)
    problem = None
    if rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            files.remove_leftovers(parent)
            os.makedirs(staging)
        except OSError as e:
            problem = e
    problem = consensus.first_failure(problem)
    if problem:
        raise RuntimeError(f"Cannot save checkpoint {final!r}: {problem}")
    state = _state_dict(model)
    storage_writer = writer.DigestingWriter(staging)
    write = functools.partial(dcp.save, state, storage_writer=storage_writer)
    if async_save:
        group = preemption.gloo_group("keras_dtensor_checkpoint_group")
        write = dcp.async_save(
            state, storage_writer=storage_writer, process_group=group
        ).result
    commit = functools.partial(
        _commit, final, staging, write, state, extra, storage_writer
    )
    return PendingCheckpoint(commit) if async_save else commit()


def load_checkpoint(model, directory):
    """Loads a checkpoint into `model` (and its optimizer), resharding.

    Any number of processes, under any layouts, may load it; a damaged
    checkpoint raises before the model is touched.

    Args:
        model: a built Keras model of the same architecture.
        directory: a checkpoint written by `save_checkpoint`.

    Returns:
        The checkpoint's manifest (a dict).

    Example:
    >>> keras_dtensor.load_checkpoint(model, "ckpt/epoch-3")
    """
    directory = os.path.abspath(os.fspath(directory))
    launch.every_rank_joins(
        f"load_checkpoint({directory!r})", "the ranks check the files together"
    )
    contents = manifest.read_manifest(directory)
    manifest.verify(directory, contents)
    state = _state_dict(model)
    world, rank = launch.world()
    rng_key = f"rng/torch/{rank}"
    if contents["processes"] != world:
        del state[rng_key]  # another number of processes: no such stream
    saved = contents["keys"]
    if "rng/keras" in state and "rng/keras" not in saved:
        del state["rng/keras"]
    problems = []
    for key, tensor in state.items():
        if key.startswith("rng/"):
            continue
        if key not in saved:
            problems.append(f"{key} is not in the checkpoint")
        elif list(tensor.shape) != saved[key][0]:
            problems.append(
                f"{key} has shape {tuple(tensor.shape)} here and "
                f"{tuple(saved[key][0])} in the checkpoint"
            )
    if problems:
        raise ValueError(
            f"Checkpoint {directory!r} does not fit this model: "
            f"{'; '.join(problems[:8])}. Nothing was loaded."
        )
    with torch.no_grad():
        dcp.load(state, storage_reader=reader.SafeReader(directory))
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    return contents


def latest_checkpoint(root, prefix=""):
    """The newest complete checkpoint under `root` by name, or `None`.

    Args:
        root: the folder of checkpoints.
        prefix: consider only names that start with it.

    Returns:
        The absolute path of the newest one with its manifest, or `None`.

    Example:
    >>> path = keras_dtensor.latest_checkpoint("ckpt")
    >>> if path is not None:
    ...     keras_dtensor.load_checkpoint(model, path)
    """
    found = os.path.isdir(root) and checkpoints(os.path.abspath(root), prefix)
    return found[-1] if found else None


def checkpoints(root, prefix=""):
    """The paths of the complete checkpoints under `root`, sorted by name."""
    entries = files.in_place_or_aside(root)
    return [
        entries[name]
        for name in sorted(entries)
        if name.startswith(prefix)
        and os.path.exists(os.path.join(entries[name], manifest.MANIFEST))
    ]


def export_weights(model, directory, filepath):
    """Writes a checkpoint's weights as an ordinary Keras `.weights.h5`.

    `load_checkpoint(model, directory)`, then `model.save_weights`.

    Example:
    >>> from keras_dtensor.checkpoint import export_weights
    >>> export_weights(model, "ckpt/epoch-3", "model.weights.h5")
    """
    load_checkpoint(model, directory)
    model.save_weights(filepath)


def import_weights(model, filepath, directory):
    """Turns a Keras `.weights.h5` into a sharded checkpoint at `directory`
    (`model.load_weights(filepath)`, then `save_checkpoint`)."""
    model.load_weights(filepath)
    return save_checkpoint(model, directory)
