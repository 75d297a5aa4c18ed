"""Sharded checkpoints: keras-dtensor against native DCP on the same state.

    python benchmarks/bench_checkpoint.py --nproc 4 --rounds 3

Starts `--nproc` processes (torchrun, gloo, one thread each). Model: an
`Embedding(--vocab, 128)` fp32 laid out `(None, "model")`, a mean over a
sequence of 4 and `Dense(256)` with kernel `(None, "model")`, Adam, one
training step (so the slots exist). Then, alternating in each round:

- `kd`: `keras_dtensor.save_checkpoint(model, dir)` and
  `load_checkpoint(model, dir)` (DCP files plus the manifest: every file
  hashed, the manifest written last, the directory renamed; a load hashes
  every file before reading);
- `dcp`: `torch.distributed.checkpoint.save` / `load` of the very same
  tensors (the variables' DTensors and slots), to a plain directory.

Per phase: wall seconds (rank 0, between barriers) and the peak resident
memory each rank added (VmHWM after resetting it through
`/proc/self/clear_refs`, minus VmRSS before), max over ranks. Printed: the
medians over rounds and the ratio kd / dcp (targets, issue #13: time
<= 1.2x, memory added <= native's).

`--device cuda`: one GPU per process (`cuda:LOCAL_RANK`), the state on
it, NCCL between processes (keras-dtensor's `cpu:gloo,cuda:nccl` group);
each phase waits for the GPU before its clock stops. Memory stays host
memory (what staging the GPU tensors costs).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _sync():
    import torch

    if torch.cuda.is_available():  # --device cpu hides the GPUs
        torch.cuda.synchronize()


def _phase(fn):
    import torch.distributed as dist

    _sync()
    dist.barrier()
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    fn()
    _sync()  # a load's copies into GPU tensors may still be queued
    dist.barrier()
    seconds = time.perf_counter() - start
    added = _status("VmHWM") - before
    return seconds, added


def worker(args):
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import keras_dtensor
    from keras_dtensor.checkpoint import api

    if args.device == "cuda":  # before any tensor: this rank's own GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        keras.distribution.initialize()  # NCCL for the GPU tensors
    world = keras.distribution.get_device_count()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embed/embeddings"] = (None, "model")
    layout_map[".*dense/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    tokens = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(args.vocab, 128, name="embed")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(256, name="dense")(h)
    model = keras.Model(tokens, outputs)
    model.compile(optimizer="adam", loss="mse")
    x = np.random.randint(0, args.vocab, size=(32, 4)).astype("int32")
    y = np.zeros((32, 256), "float32")
    model.train_on_batch(x, y)
    state = api._state_dict(model)
    rank = dist.get_rank()
    root = args.root
    rows = []
    for r in range(args.rounds):
        order = ("kd", "dcp") if r % 2 == 0 else ("dcp", "kd")
        for variant in order:
            path = os.path.join(root, f"{variant}-{r}")
            if variant == "kd":
                save = lambda p=path: keras_dtensor.save_checkpoint(model, p)  # noqa: E731
                load = lambda p=path: keras_dtensor.load_checkpoint(model, p)  # noqa: E731
            else:

                def save(p=path):
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(p))

                def load(p=path):
                    with torch.no_grad():
                        dcp.load(state, storage_reader=dcp.FileSystemReader(p))

            save_s, save_b = _phase(save)
            load_s, load_b = _phase(load)
            gathered = [None] * world
            dist.all_gather_object(gathered, (save_b, load_b))
            rows.append(
                {
                    "variant": variant,
                    "save_s": save_s,
                    "load_s": load_s,
                    "save_added": max(g[0] for g in gathered),
                    "load_added": max(g[1] for g in gathered),
                }
            )
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        with open(os.path.join(root, "rows.json"), "w") as f:
            json.dump(rows, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: one GPU per process, NCCL (needs --nproc GPUs)",
    )
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--root")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    root = tempfile.mkdtemp(prefix="bench_checkpoint_")
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
    if args.device == "cpu":  # Keras picks a visible GPU by itself
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        os.path.abspath(__file__),
        "--worker",
        f"--root={root}",
        f"--rounds={args.rounds}",
        f"--vocab={args.vocab}",
        f"--device={args.device}",
    ]
    subprocess.run(command, env=env, check=True)
    with open(os.path.join(root, "rows.json")) as f:
        rows = json.load(f)
    shutil.rmtree(root, ignore_errors=True)
    table = {}
    for variant in ("kd", "dcp"):
        mine = [r for r in rows if r["variant"] == variant]
        table[variant] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("save_s", "load_s", "save_added", "load_added")
        }
    mib = 2**20
    print(f"{args.nproc} processes, vocab {args.vocab}, {args.rounds} rounds")
    print("variant  save s  load s  save +MiB/rank  load +MiB/rank")
    for variant, t in table.items():
        print(
            f"{variant:7s} {t['save_s']:7.2f} {t['load_s']:7.2f} "
            f"{t['save_added'] / mib:15.0f} {t['load_added'] / mib:15.0f}"
        )
    kd, native = table["kd"], table["dcp"]
    print(
        f"kd / dcp: save {kd['save_s'] / native['save_s']:.2f}x, load "
        f"{kd['load_s'] / native['load_s']:.2f}x; memory added: save "
        f"{kd['save_added'] / mib:.0f} vs {native['save_added'] / mib:.0f} "
        f"MiB, load {kd['load_added'] / mib:.0f} vs "
        f"{native['load_added'] / mib:.0f} MiB"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "table": table,
                    "device": args.device,
                    "nproc": args.nproc,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
