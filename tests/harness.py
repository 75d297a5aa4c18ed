"""Runs a function on N real processes joined by a gloo process group.

Modelled on torch's `DTensorTestBase`: each rank is a process of its own,
the group is started through `keras.distribution.initialize` with a
`file://` rendezvous (no fixed ports), every rank is bounded in
time, and a failure is re-raised naming every failed rank with its
traceback (and any rank that died without one).

Ranks are forked from a `forkserver` that has imported torch and Keras
once and done nothing else (no thread, no TensorFlow, no keras_dtensor,
no Keras state touched), so a group no longer pays seconds of imports in
every rank; a rank sees the environment its
caller has when it starts the group, as a spawned one would.

The function runs with the group up and returns a picklable value; the
harness returns the list of values, by rank.
"""

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import tempfile
import traceback

__all__ = ["RankError", "run_ranks"]

DEFAULT_TIMEOUT = 240
# Imported once by the forkserver. Not keras_hub (it imports TensorFlow,
# which most ranks must not see) nor keras_dtensor (its import is what
# the tests exercise).
PRELOAD = ["torch", "keras"]
# Seconds to wait for the other ranks' reports once one has failed.
GRACE = 10


class RankError(RuntimeError):
    """A rank raised, or did not finish in time."""


def _child(fn, rank, world_size, init_file, args, results, tensorflow, env):
    # The caller's environment now, not the forkserver's at its start.
    os.environ.clear()
    os.environ.update(env)
    if not tensorflow:
        # Keras's set_random_seed imports TensorFlow whenever it is
        # installed (to seed tf.data), seconds per rank: only the tf.data
        # tests pay for it.
        sys.modules.setdefault("tensorflow", None)
    os.environ.update(
        {
            "KERAS_BACKEND": "torch",
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "KERAS_DTENSOR_INIT_METHOD": f"file://{init_file}",
            "KERAS_DTENSOR_TIMEOUT": "120",
        }
    )
    try:
        import torch

        torch.set_num_threads(1)
        import keras

        import keras_dtensor  # noqa: F401

        keras.distribution.initialize()
        value = fn(*args)
        # Pickled here: the queue pickles in a thread of its own, where a
        # failure is only printed and the parent waits out its timeout.
        pickle.dumps(value)
        results.put((rank, True, value))
    except BaseException:  # noqa: B036 - report everything, then exit
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn,
    world_size,
    *args,
    timeout=DEFAULT_TIMEOUT,
    tensorflow=False,
    children=False,
):
    """Runs `fn(*args)` on `world_size` ranks; returns their results.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of processes.
        *args: picklable arguments passed to every rank.
        timeout: seconds for the whole group.
        tensorflow: let the ranks import TensorFlow (else it counts as
            not installed).
        children: let the ranks start processes of their own (DataLoader
            workers): they are then not daemons, and are still killed
            here if they outlive the timeout.

    Returns:
        The list of return values, indexed by rank.

    Raises:
        RankError: naming the failing rank and its traceback, or the
            ranks that did not finish in time.
    """
    # Forked from one server, the ranks share its string-hash seed; plain
    # torchrun's ranks do not (keras_dtensor.backend.placement_order makes
    # that safe): test_cli's torchrun tests keep that case covered.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn,
                    rank,
                    world_size,
                    init_file,
                    args,
                    results,
                    tensorflow,
                    dict(os.environ),
                ),
                daemon=not children,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        values, errors = {}, {}
        try:
            for _ in range(world_size):
                # Once a rank has failed, its peers may block on a
                # collective: the others' reports are waited for briefly,
                # so that the rank that failed first is among them.
                rank, ok, value = results.get(
                    timeout=GRACE if errors else timeout
                )
                if ok:
                    values[rank] = value
                else:
                    errors[rank] = value
        except queue.Empty:
            pass
        finally:
            for proc in procs:
                proc.join(timeout=5 if errors else 30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        codes = {rank: proc.exitcode for rank, proc in enumerate(procs)}
    silent = [
        rank
        for rank, code in codes.items()
        if rank not in values
        and rank not in errors
        and code not in (0, None)
        and code != -signal.SIGKILL  # killed here, after a failure
    ]
    if errors or silent:
        raise RankError(_failures(world_size, errors, silent, codes))
    missing = sorted(set(range(world_size)) - set(values))
    if missing:
        raise RankError(
            f"ranks {missing} of {world_size} did not finish within {timeout} s"
        )
    return [values[r] for r in range(world_size)]


def _failures(world_size, errors, silent, codes):
    """Every failed rank's traceback, and the ranks that died without one
    (a signal, `os._exit`): a peer's "Connection closed by peer" is often
    only the echo of another rank's death."""
    parts = [
        f"rank {rank} of {world_size} exited with {_exit(codes[rank])} "
        "without a report"
        for rank in silent
    ]
    parts += [
        f"rank {rank} of {world_size} failed:\n{tb}"
        for rank, tb in sorted(errors.items())
    ]
    return "\n".join(parts)


def _exit(code):
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"code {code}"
