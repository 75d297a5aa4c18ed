"""Time and peak memory of saving a sharded model, against torch DCP.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc_per_node=4 benchmarks/bench_save.py [DIR] [--json OUT] \\
        [--cases new,old,dcp]

An Embedding(VOCAB, WIDTH) fp32 table laid out `(None, "model")` and a
Dense(UNITS) kernel `(None, "model")` on a (1, processes) mesh, Adam, one
`fit` step (so the optimizer slots exist). Then, in one run (`--cases`
picks among them):

- `save_weights` and `model.save` as shipped: sharded variables streamed
  to rank 0 in pieces (`saving/h5_stream.py`), `model.save`'s zip written
  with the weights in place (`saving/zip_writer.py`);
- "old": the same with those three entries of the table off, which is the
  save before streaming (every rank gathers every variable);
- `torch.distributed.checkpoint.save` of the same variables (model and
  optimizer, as DTensors): every rank writes its own shards.

Each is timed on rank 0 from a barrier to its return (every save ends in
a collective, so every rank has finished) and repeated `--repeat` times,
the order of the cases reversed every other round (best time kept, and
each round's ratio to that round's DCP, with their median; the previous
save runs once: it is much slower); memory
is each rank's resident high-water mark during it (`/proc/self/status`
VmHWM after resetting it) over its resident memory before it, as a
fraction of the model's weights (the table and kernel), the largest over
the repeats. Files go to DIR (default: the temporary directory) and are
deleted after each measurement; dirty pages are flushed (`os.sync`)
before each, outside the timing. DCP writes with its default
`sync_files=True` (an fsync per file): Keras's writer does not fsync.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import keras_dtensor  # noqa: F401 - before keras: KERAS_BACKEND=torch
from keras_dtensor.backend import launch

VOCAB, WIDTH, UNITS, SEQ = 1_000_000, 128, 256, 8


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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
        (
            "keras.src.optimizers.base_optimizer",
            "BaseOptimizer",
            "save_own_variables",
        ),
    )

    def _owners(self):
        import importlib

        for module, cls, name in self._ROWS:
            owner = importlib.import_module(module)
            yield (getattr(owner, cls) if cls else owner), name

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
    before = _status_mb("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM") - before
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
    parser.add_argument(
        "--cases",
        default="new,old,dcp",
        help="comma-separated: new, old, dcp (dcp is the time reference)",
    )
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
        piece = os.environ.get("KERAS_DTENSOR_SAVE_PIECE_MB", "16 (default)")
        print(
            f"model weights {model_mb:.0f} MB, {dist.get_world_size()} "
            f"ranks, piece {piece} MB, best of {args.repeat}, torch "
            f"{torch.__version__}"
        )
        dcp_s = results["dcp"]["seconds"]
        dcp_rounds = results["dcp"]["rounds"]
        for key, r in results.items():
            fractions = ", ".join(f"{p / model_mb:.2f}" for p in r["peak_mb"])
            # Each round's ratio to that round's DCP; their median.
            ratios = [s / dcp_rounds[i] for i, s in sorted(r["rounds"].items())]
            r["round_ratios"] = ratios
            r["median_ratio"] = statistics.median(ratios)
            print(
                f"{key:18s} {r['seconds']:6.2f} s ({r['seconds'] / dcp_s:4.1f}x"
                f" DCP); peak increase per rank / model: {fractions}; ratio "
                f"by round {r['median_ratio']:.2f} median of "
                f"{', '.join(f'{x:.2f}' for x in ratios)}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model_mb": model_mb, "results": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
