"""Time and peak memory of saving a sharded model, against torch DCP.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc_per_node=4 benchmarks/bench_save.py [DIR] [--json OUT] \\
        [--cases new,dcp]

`save_weights` and `model.save` ("new") against DCP of the same
variables, alternating; each timed on rank 0, memory as each rank's VmHWM
over its RSS before.
"""

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import bench_harness as harness
import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import keras_dtensor  # noqa: F401 - before keras: KERAS_BACKEND=torch
from keras_dtensor.backend import launch

VOCAB, WIDTH, UNITS, SEQ = 1_000_000, 128, 256, 8


def _build():
    import keras

    layouts = {".*table/embeddings": (None, "model")}
    harness.model_parallel(keras, {**layouts, ".*head/kernel": (None, "model")})
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="table")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(tokens, keras.layers.Dense(UNITS, name="head")(h))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (16, SEQ)).astype("int32")
    y = rng.standard_normal((16, UNITS)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model


def _measure(run, directory):
    """`(seconds on rank 0, this rank's peak increase in MB)`."""
    gc.collect()
    if dist.get_rank() == 0:
        os.sync()  # every case starts without the last one's dirty pages
    dist.barrier()
    before = harness.status()["VmRSS"]
    harness.reset_peak()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = (harness.status()["VmHWM"] - before) / 2**20
    dist.barrier()
    if dist.get_rank() == 0:  # empty again
        shutil.rmtree(directory)
        os.mkdir(directory)
    dist.barrier()
    return seconds, peak


def main():
    sys.modules.setdefault("tensorflow", None)  # torch-only environment
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", nargs="?")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--cases", default="new,dcp", help="dcp: always")
    args = parser.parse_args()
    import keras

    keras.distribution.initialize()
    rank = dist.get_rank()
    base = args.directory or tempfile.gettempdir()
    mine = tempfile.mkdtemp(prefix="bench_save_", dir=base) if rank == 0 else ""
    directory = launch.broadcast_bytes(mine.encode() if rank == 0 else None)
    directory = directory.decode()
    model = _build()
    model_mb = sum(
        np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.weights
    )
    model_mb /= 2**20
    weights = os.path.join(directory, "m.weights.h5")
    archive = os.path.join(directory, "m.keras")
    state = {v.path: v.value for v in model.weights}
    for v in model.optimizer.variables:
        state["optimizer/" + v.path] = v.value
    runs = {
        "new save_weights": lambda: model.save_weights(weights),
        "new save": lambda: model.save(archive),
        "dcp": lambda: dcp.save(state, checkpoint_id=directory + "/dcp"),
    }
    chosen = set(args.cases.split(",")) | {"dcp"}
    cases = [key for key in runs if key.split()[0] in chosen]
    results = {}
    for round_ in range(args.repeat):
        # Alternating order: the shared machine's drift hits both sides.
        for key in cases if round_ % 2 == 0 else cases[::-1]:
            got = _measure(runs[key], directory)
            seconds = launch.all_gather_ints(int(got[0] * 1e6))[0] / 1e6
            peaks = launch.all_gather_ints(int(got[1]))
            best = results.setdefault(
                key, {"seconds": seconds, "peak_mb": peaks}
            )
            best["seconds"] = min(best["seconds"], seconds)
            best.setdefault("rounds", {})[round_] = seconds
            best["peak_mb"] = [
                max(a, b) for a, b in zip(best["peak_mb"], peaks, strict=True)
            ]
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        dcp_rounds = results["dcp"]["rounds"]
        print(f"weights {model_mb:.0f} MB, {dist.get_world_size()} ranks")
        for key, r in results.items():
            ratios = [s / dcp_rounds[i] for i, s in sorted(r["rounds"].items())]
            r["round_ratios"] = ratios
            r["median_ratio"] = statistics.median(ratios)
            fractions = [round(p / model_mb, 2) for p in r["peak_mb"]]
            print(
                f"{key}: best {r['seconds']:.2f} s, ratio to DCP by round "
                f"{ratios}, peak per rank / model {fractions}"
            )
        harness.write_json(
            args.json, {"model_mb": model_mb, "results": results}
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
