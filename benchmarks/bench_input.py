"""Input work per rank: DataParallel against DDP with a `DistributedSampler`.

    python benchmarks/bench_input.py --rounds 3 \\
        --out benchmarks/results-input.json

An input-bound map-style dataset (`Slow`): the loader bounds the epoch,
as on a GPU. Goal: samples read per rank at most the global count ÷ N
plus one batch, and an epoch within DDP's.
"""

import os
import statistics
import sys
import time

import bench_harness as harness

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
    layers = [keras.Input((WIDTH,)), keras.layers.Dense(64, "relu")]
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
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
    times = []

    class Timer(keras.callbacks.Callback):  # the epoch's begin and end
        def on_epoch_begin(self, epoch, logs=None):
            torch.distributed.barrier()
            times.append(time.perf_counter())

        on_epoch_end = on_epoch_begin

    model.fit(data, epochs=1, verbose=0, callbacks=[Timer()])
    return times[1] - times[0]


def worker(args):
    harness.start_worker()
    dataset = Slow(args.sample_ms)
    if args.variant == "ddp_sampler":
        seconds = _ddp(dataset, int(os.environ["WORLD_SIZE"]))
    else:
        seconds = _keras(dataset, args.variant)
    result = {"seconds": seconds, "reads": dataset.reads}
    harness.write_result(args.result_dir, result)


def main(argv=None):
    parser = harness.parser(__doc__, rounds=3)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--nprocs", default="2,4")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    command = f"python benchmarks/bench_input.py --rounds {args.rounds} "
    command += f"--sample-ms {args.sample_ms} --nprocs {args.nprocs}"
    result = harness.record(command, rounds=args.rounds, rows=[])
    result.update(sample_ms=args.sample_ms, samples=SAMPLES, batch=BATCH)
    for nproc in map(int, args.nprocs.split(",")):

        def run(variant, nproc=nproc):
            env = {}
            if variant == "kd_whole":
                env["KERAS_DTENSOR_SHARDED_LOADING"] = "0"
            flags = [f"--variant={variant}", f"--sample-ms={args.sample_ms}"]
            return harness.launch(__file__, nproc, flags, env)

        runs = harness.rounds(args.rounds, VARIANTS, run)
        ddp = [ranks[0]["seconds"] for ranks in runs["ddp_sampler"]]
        for variant, rounds in runs.items():
            seconds = [ranks[0]["seconds"] for ranks in rounds]
            row = {"processes": nproc, "variant": variant}
            row["epoch_s"] = statistics.median(seconds)
            row["over_ddp"] = harness.per_round(seconds, ddp)[1]
            row["reads_per_rank"] = max(r["reads"] for r in rounds[-1])
            row["goal_reads"] = SAMPLES // nproc + BATCH
            result["rows"].append(row)
    harness.write_json(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
