"""Runs a function on N real processes joined by a gloo process group.

Modelled on torch's `DTensorTestBase`: each rank is a fresh `spawn`ed
interpreter, the group is started through `keras.distribution.initialize`
with a `file://` rendezvous (no fixed ports), every rank is bounded in
time, and a failure is re-raised naming its rank with its traceback.

The function runs with the group up and returns a picklable value; the
harness returns the list of values, by rank.
"""

import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import traceback

__all__ = ["RankError", "run_ranks"]

DEFAULT_TIMEOUT = 240


class RankError(RuntimeError):
    """A rank raised, or did not finish in time."""


def _child(fn, rank, world_size, init_file, args, results, tensorflow):
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


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, tensorflow=False):
    """Runs `fn(*args)` on `world_size` ranks; returns their results.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of processes.
        *args: picklable arguments passed to every rank.
        timeout: seconds for the whole group.
        tensorflow: let the ranks import TensorFlow (else it counts as
            not installed).

    Returns:
        The list of return values, indexed by rank.

    Raises:
        RankError: naming the failing rank and its traceback, or the
            ranks that did not finish in time.
    """
    # No PYTHONHASHSEED: ranks hash strings differently, as under plain
    # torchrun (keras_dtensor.backend.placement_order makes that safe).
    ctx = multiprocessing.get_context("spawn")
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
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        values, errors = {}, []
        try:
            for _ in range(world_size):
                rank, ok, value = results.get(timeout=timeout)
                if ok:
                    values[rank] = value
                else:
                    errors.append((rank, value))
                    break  # peers may now block on a collective
        except queue.Empty:
            pass
        finally:
            for proc in procs:
                proc.join(timeout=5 if errors else 30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if errors:
        rank, tb = errors[0]
        raise RankError(f"rank {rank} of {world_size} failed:\n{tb}")
    missing = sorted(set(range(world_size)) - set(values))
    if missing:
        raise RankError(
            f"ranks {missing} of {world_size} did not finish within {timeout} s"
        )
    return [values[r] for r in range(world_size)]
