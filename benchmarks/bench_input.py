"""Input work per rank: keras-dtensor's DataParallel against DDP with a
`DistributedSampler`, on an input-bound map-style dataset.

    python benchmarks/bench_input.py --rounds 3 \
        --out benchmarks/results-input.json

Each sample costs `--sample-ms` of CPU in `__getitem__` (a stand-in for
decoding and augmentation), so the epoch is bound by the loader, as on a
GPU. One epoch of 512 samples at a global batch of 32 (16 per rank at 2
processes), shuffled, a small MLP. Variants, each in fresh processes
(`torch.distributed.run`, one thread each), in alternating order per
round:

- `ddp_sampler`: torch DDP, `DataLoader(batch_size=32 / N,
  sampler=DistributedSampler(shuffle=True))`;
- `kd_sharded`: Keras `fit` under keras-dtensor's `DataParallel` on
  `DataLoader(batch_size=32, shuffle=True)`: each rank loads its shard;
- `kd_whole`: the same with `KERAS_DTENSOR_SHARDED_LOADING=0`: each rank
  loads the whole global batch (before issue 49);
- `kd_pydataset`: a `PyDataset` of the same batches (read whole by every
  rank: its `__getitem__` builds a whole batch).

Per variant: the epoch's seconds (median over rounds, timed by rank 0
around the epoch, Keras's first-batch build outside it) and the samples
each rank's dataset read in it, Keras's build included. Target (issue
49): samples per rank = 512 / N plus at most one batch; epoch time of
`kd_sharded` ≤ 1.1 × `ddp_sampler`.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step import head_commit  # noqa: E402
from bench_step import run_workers  # noqa: E402

VARIANTS = ("ddp_sampler", "kd_sharded", "kd_whole", "kd_pydataset")
SAMPLES, BATCH, WIDTH = 512, 32, 64


class Slow:
    """A map-style dataset whose every sample costs `ms` of CPU."""

    def __init__(self, ms):
        import numpy as np

        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(SAMPLES, WIDTH)).astype("float32")
        self.y = rng.normal(size=(SAMPLES, 1)).astype("float32")
        self.ms, self.reads = ms, 0

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        self.reads += 1
        end = time.perf_counter() + self.ms / 1000
        while time.perf_counter() < end:
            pass
        return self.x[i], self.y[i]


def _ddp(dataset, world):
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters())
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH // world, sampler=sampler)
    dist.barrier()
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    dist.barrier()
    return time.perf_counter() - start


def _keras(dataset, variant):
    import keras
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    import keras_dtensor  # noqa: F401

    keras.distribution.initialize()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            keras.layers.Dense(64, "relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    if variant == "kd_pydataset":

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return SAMPLES // BATCH

            def __getitem__(self, b):
                rows = [dataset[i] for i in range(b * BATCH, (b + 1) * BATCH)]
                xs, ys = zip(*rows, strict=True)
                return np.stack(xs), np.stack(ys)

        data = Batches()
    else:
        data = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    times = {}

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            torch.distributed.barrier()
            times["start"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            torch.distributed.barrier()
            times["end"] = time.perf_counter()

    model.fit(data, epochs=1, verbose=0, callbacks=[Timer()])
    return times["end"] - times["start"]


def worker(args):
    sys.modules.setdefault("tensorflow", None)  # see bench_step.worker
    import torch

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    dataset = Slow(args.sample_ms)
    if args.variant == "ddp_sampler":
        seconds = _ddp(dataset, world)
    else:
        seconds = _keras(dataset, args.variant)
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "seconds": seconds, "reads": dataset.reads}, f)


def _launch(variant, nproc, sample_ms):
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    if variant == "kd_whole":
        env["KERAS_DTENSOR_SHARDED_LOADING"] = "0"
    return run_workers(
        __file__,
        nproc,
        [f"--variant={variant}", f"--sample-ms={sample_ms}"],
        env,
        variant,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "mode", nargs="?", default="bench", choices=["bench", "worker"]
    )
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--out", default=None)
    parser.add_argument("--result-dir", default=None)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    rows = []
    for nproc in map(int, args.nprocs.split(",")):
        seconds = {v: [] for v in VARIANTS}
        reads = {}
        for round_ in range(args.rounds):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                ranks = _launch(variant, nproc, args.sample_ms)
                seconds[variant].append(ranks[0]["seconds"])
                reads[variant] = [r["reads"] for r in ranks]
                print(
                    f"{nproc} processes, round {round_ + 1}, {variant}: "
                    f"{ranks[0]['seconds']:.2f} s, reads {reads[variant]}",
                    flush=True,
                )
        ddp = seconds["ddp_sampler"]
        for variant in VARIANTS:
            ratios = [s / d for s, d in zip(seconds[variant], ddp, strict=True)]
            rows.append(
                {
                    "processes": nproc,
                    "variant": variant,
                    "epoch_s": statistics.median(seconds[variant]),
                    "over_ddp": statistics.median(ratios),
                    "reads_per_rank": max(reads[variant]),
                    "goal_reads": SAMPLES // nproc + BATCH,
                }
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": head_commit(),
        "command": (
            f"python benchmarks/bench_input.py --rounds {args.rounds} "
            f"--sample-ms {args.sample_ms} --nprocs {args.nprocs}"
        ),
        "rounds": args.rounds,
        "sample_ms": args.sample_ms,
        "samples": SAMPLES,
        "batch": BATCH,
        "rows": rows,
    }
    for row in rows:
        print(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
