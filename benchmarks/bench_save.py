"""Time and peak memory of saving a sharded model, against torch DCP.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc_per_node=4 benchmarks/bench_save.py [DIR] [--json OUT] \\
        [--cases new,old,dcp]

An Embedding(1M, 128) laid out `(None, "model")` and a Dense(256) kernel
`(None, "model")` on a (1, processes) mesh, Adam, one `fit` step. Cases:
`save_weights` and `model.save` as shipped ("new": streamed to rank 0 in
pieces, the zip written in place), the same with those patch entries off
("old": every rank gathers every variable; once, it is much slower), and
`torch.distributed.checkpoint.save` of the same variables ("dcp", the
reference; default `sync_files=True`). Each is timed on rank 0 from a
barrier to its return, `--repeat` times in alternating order (best time,
and each round's ratio to that round's DCP with their median); memory is
each rank's VmHWM during it over its RSS before, as a fraction of the
model's weights. Files go to DIR and are deleted after each measurement;
dirty pages are flushed before each, outside the timing.
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

    world = keras.distribution.get_device_count()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*table/embeddings"] = (None, "model")
    layout_map[".*head/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(distribution)
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="table")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(UNITS, name="head")(h)
    model = keras.Model(tokens, outputs)
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (16, SEQ)).astype("int32")
    y = rng.standard_normal((16, UNITS)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model


class _Gathering:
    """The save before streaming: its three entries of the table off."""

    _ROWS = (
        ("keras.src.saving.saving_lib", "H5IOStore", "__setitem__"),
        ("keras.src.saving.saving_lib", None, "_save_model_to_fileobj"),
        ("keras.src.optimizers.base_optimizer", "BaseOptimizer", None),
    )

    def _owners(self):
        import importlib

        for module, cls, name in self._ROWS:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            yield owner, name or "save_own_variables"

    def __enter__(self):
        self._saved = []
        for owner, name in self._owners():
            current = getattr(owner, name)
            self._saved.append((owner, name, current))
            setattr(owner, name, current.__wrapped__)

    def __exit__(self, *exc):
        for owner, name, current in self._saved:
            setattr(owner, name, current)


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
    if dist.get_rank() == 0:
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    dist.barrier()
    return seconds, peak


def _dcp_state(model):
    state = {v.path: v.value for v in model.weights}
    for v in model.optimizer.variables:
        state["optimizer/" + v.path] = v.value
    return state


def main():
    sys.modules.setdefault("tensorflow", None)  # torch-only environment
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", nargs="?")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--cases", default="new,old,dcp", help="dcp: always")
    args = parser.parse_args()
    import keras

    keras.distribution.initialize()
    rank = dist.get_rank()
    base = args.directory or tempfile.gettempdir()
    launch_dir = None
    if rank == 0:
        launch_dir = tempfile.mkdtemp(prefix="bench_save_", dir=base)
    directory = launch.broadcast_bytes(
        launch_dir.encode() if rank == 0 else None
    ).decode()
    model = _build()
    model_mb = (
        sum(
            np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.weights
        )
        / 2**20
    )
    weights = os.path.join(directory, "m.weights.h5")
    archive = os.path.join(directory, "m.keras")
    state = _dcp_state(model)
    runs = {
        "save_weights": lambda: model.save_weights(weights),
        "save": lambda: model.save(archive),
        "dcp": lambda: dcp.save(state, checkpoint_id=directory + "/dcp"),
    }
    cases = [
        ("new", "save_weights"),
        ("new", "save"),
        ("old", "save_weights"),
        ("old", "save"),
        ("dcp", "dcp"),
    ]
    chosen = set(args.cases.split(",")) | {"dcp"}
    cases = [(mode, what) for mode, what in cases if mode in chosen]
    results = {}
    for round_ in range(args.repeat):
        # Alternating order: the shared machine's drift hits both sides.
        for mode, what in cases if round_ % 2 == 0 else cases[::-1]:
            if mode == "old" and round_ > 0:
                continue  # much slower: once is enough
            if mode == "old":
                with _Gathering():
                    got = _measure(runs[what], directory)
            else:
                got = _measure(runs[what], directory)
            key = f"{mode} {what}" if mode != "dcp" else "dcp"
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
            # Each round's ratio to that round's DCP; their median.
            ratios = [s / dcp_rounds[i] for i, s in sorted(r["rounds"].items())]
            r.update(
                round_ratios=ratios, median_ratio=statistics.median(ratios)
            )
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
