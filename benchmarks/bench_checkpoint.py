"""Sharded checkpoints: keras-dtensor against native DCP on the same state.

    python benchmarks/bench_checkpoint.py --nproc 4 --rounds 3

`kd` (`save_checkpoint`/`load_checkpoint`) and `dcp` of the very same
tensors, alternating: seconds between barriers and the peak memory each
rank added, the largest over ranks; medians over rounds.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import bench_harness as harness


def _phase(fn):
    import torch.distributed as dist

    harness.sync()
    dist.barrier()
    harness.reset_peak()
    before = harness.status()["VmRSS"]
    start = time.perf_counter()
    fn()
    harness.sync()  # a load's copies into GPU tensors may still be queued
    dist.barrier()
    return time.perf_counter() - start, harness.status()["VmHWM"] - before


def worker(args):
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import keras_dtensor
    from keras_dtensor.checkpoint import api

    harness.start_worker()
    if harness.cuda():
        keras.distribution.initialize()  # NCCL for the GPU tensors
    layouts = {".*embed/embeddings": (None, "model")}
    harness.model_parallel(
        keras, {**layouts, ".*dense/kernel": (None, "model")}
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
    rows = []
    for r in range(args.rounds):
        for variant in ("kd", "dcp") if r % 2 == 0 else ("dcp", "kd"):
            path = os.path.join(args.root, f"{variant}-{r}")
            if variant == "kd":
                save = lambda p=path: keras_dtensor.save_checkpoint(model, p)  # noqa: E731
                load = lambda p=path: keras_dtensor.load_checkpoint(model, p)  # noqa: E731
            else:

                def save(p=path):
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(p))

                def load(p=path):
                    with torch.no_grad():
                        dcp.load(state, storage_reader=dcp.FileSystemReader(p))

            (save_s, save_b), (load_s, load_b) = _phase(save), _phase(load)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (save_b, load_b))
            row = {"variant": variant, "save_s": save_s, "load_s": load_s}
            row["save_added"] = max(g[0] for g in gathered)
            row["load_added"] = max(g[1] for g in gathered)
            rows.append(row)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
    harness.write_result(args.result_dir, {"rows": rows})


def main(argv=None):
    parser = harness.parser(__doc__, rounds=3, nproc=4, device=True)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    with tempfile.TemporaryDirectory() as root:
        flags = [f"--root={root}", f"--rounds={args.rounds}"]
        flags.append(f"--vocab={args.vocab}")
        ranks = harness.launch(__file__, args.nproc, flags, None, args.device)
    rows, table = ranks[0]["rows"], {}
    for variant in ("kd", "dcp"):
        mine = [r for r in rows if r["variant"] == variant]
        table[variant] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("save_s", "load_s", "save_added", "load_added")
        }
    result = {"rows": rows, "table": table, "device": args.device}
    harness.write_json(args.out, dict(result, nproc=args.nproc))


if __name__ == "__main__":
    sys.exit(main())
