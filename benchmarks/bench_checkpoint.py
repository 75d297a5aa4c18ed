"""Saving and loading a sharded model: keras-dtensor against DCP.

    python benchmarks/bench_checkpoint.py --nproc 4 --rounds 3

An `Embedding(--vocab, 128)` and a `Dense(256)` kernel laid out
`(None, "model")`, Adam, one step (so the slots exist). In each round,
alternating: `kd` (`save_checkpoint` / `load_checkpoint`), `save_weights`
(/ `load_weights`), `model.save` (save only) and `dcp` (DCP's `save` /
`load` of the very same tensors). Per phase: wall seconds between
barriers, the peak memory each rank added (the largest over ranks), and
the median of each round's ratio to that round's DCP.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import bench_harness as harness

VARIANTS = ("kd", "save_weights", "model.save", "dcp")


def _phase(fn):
    import torch.distributed as dist

    harness.sync()
    if dist.get_rank() == 0:
        os.sync()  # no phase pays for the last one's dirty pages
    dist.barrier()
    harness.reset_peak()
    before = harness.status()["VmRSS"]
    start = time.perf_counter()
    fn()
    harness.sync()  # a load's copies into GPU tensors may still be queued
    dist.barrier()
    return time.perf_counter() - start, harness.status()["VmHWM"] - before


def _calls(model, state, variant, path):
    """The (save, load) of `variant` at `path`; load None: not timed."""
    import torch
    import torch.distributed.checkpoint as dcp

    import keras_dtensor

    if variant == "kd":
        return (
            lambda: keras_dtensor.save_checkpoint(model, path),
            lambda: keras_dtensor.load_checkpoint(model, path),
        )
    if variant == "save_weights":
        path += ".weights.h5"
        save = lambda: model.save_weights(path)  # noqa: E731
        return save, lambda: model.load_weights(path)
    if variant == "model.save":
        return lambda: model.save(path + ".keras"), None

    def load():
        with torch.no_grad():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))

    return lambda: dcp.save(state, checkpoint_id=path), load


def worker(args):
    import keras
    import numpy as np
    import torch.distributed as dist

    import keras_dtensor  # noqa: F401
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
    variants = args.variants.split(",")
    rows = []
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            root = os.path.join(args.root, f"{r}")
            if dist.get_rank() == 0:
                os.makedirs(root, exist_ok=True)
            save, load = _calls(model, state, variant, f"{root}/{variant}")
            row = {"variant": variant, "round": r}
            for phase, call in (("save", save), ("load", load)):
                if call is not None:
                    seconds, added = _phase(call)
                    gathered = [None] * dist.get_world_size()
                    dist.all_gather_object(gathered, added)
                    row.update({f"{phase}_s": seconds})
                    row[f"{phase}_added"] = max(gathered)
            rows.append(row)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
    harness.write_result(args.result_dir, {"rows": rows})


def main(argv=None):
    parser = harness.parser(__doc__, rounds=3, nproc=4, device=True)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    variants = [v for v in args.variants.split(",") if v != "dcp"] + ["dcp"]
    with tempfile.TemporaryDirectory() as root:
        flags = [f"--root={root}", f"--rounds={args.rounds}"]
        flags += [f"--vocab={args.vocab}", f"--variants={','.join(variants)}"]
        ranks = harness.launch(__file__, args.nproc, flags, None, args.device)
    rows, table = ranks[0]["rows"], {}
    reference = {r["round"]: r for r in rows if r["variant"] == "dcp"}
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        figures = table[variant] = {}
        for key in ("save_s", "load_s", "save_added", "load_added"):
            if key in mine[0]:
                figures[key] = statistics.median(r[key] for r in mine)
        for key in ("save_s", "load_s"):
            if key in mine[0]:
                ratios = [r[key] / reference[r["round"]][key] for r in mine]
                figures[f"{key[:-2]}_over_dcp"] = statistics.median(ratios)
        print(variant, {k: round(v, 3) for k, v in figures.items()})
    result = {"rows": rows, "table": table, "device": args.device}
    harness.write_json(args.out, dict(result, nproc=args.nproc))


if __name__ == "__main__":
    sys.exit(main())
