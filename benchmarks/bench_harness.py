"""What the benchmarks share: fresh processes, alternating rounds, clocks,
memory figures and JSON.

A benchmark script is its own worker: `launch` runs `script worker ARGS
--result-dir DIR` in fresh processes, one thread each; each rank hands
back a dict (`write_result`). `rounds` reverses every other round and
`per_round` takes ratios within a round: the shared machine drifts
between rounds by more than the margins.
"""

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {
    "OMP_NUM_THREADS": "1",
    "KERAS_BACKEND": "torch",
    "PYTHONHASHSEED": "0",
    "KERAS_DTENSOR_LOG_ALL_RANKS": "0",
}
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch(script, nproc, arguments, env=None, device="cpu"):
    """Each rank's result of `script worker *arguments` on `nproc` fresh
    processes (`nproc=0`: one process outside `torch.distributed.run`)."""
    env = {**os.environ, **ENV, "BENCH_DEVICE": device, **(env or {})}
    if device == "cpu":  # Keras picks a visible GPU by itself
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, os.path.abspath(script), "worker", *arguments]
    if nproc:
        command[1:1] = [*TORCHRUN[1:], f"--nproc_per_node={nproc}"]
    else:
        for name in LAUNCHER:
            env.pop(name, None)
    with tempfile.TemporaryDirectory() as result_dir:
        command.append(f"--result-dir={result_dir}")
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        files = sorted(os.listdir(result_dir))
        if proc.returncode != 0 or len(files) != max(nproc, 1):
            name = " ".join(arguments)
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        results = []
        for name in files:
            with open(os.path.join(result_dir, name)) as f:
                results.append(json.load(f))
    return sorted(results, key=lambda r: r["rank"])


def parser(doc, out=True, rounds=None, nproc=None, device=False):
    """A benchmark's parser: `mode` ("worker" in launched processes), the
    hidden `--result-dir`, and the flags it shares with others: `--out`,
    `--rounds`, `--nproc` (given defaults), `--device`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="bench")
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    if out:
        parser.add_argument("--out", help="write the results JSON here")
    for flag, default in (("--rounds", rounds), ("--nproc", nproc)):
        if default:
            parser.add_argument(flag, type=int, default=default)
    if device:
        parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    return parser


def model_parallel(keras, layouts, shape=None):
    """Sets ModelParallel with `layouts` ({path: axes}) on a mesh of
    `shape` ((1, devices) by default), axes "batch" then "model"."""
    shape = shape or (1, keras.distribution.get_device_count())
    axes = ["batch", "model"][: len(shape)]
    layout_map = keras.distribution.LayoutMap(
        keras.distribution.DeviceMesh(shape, axes)
    )
    for key, value in layouts.items():
        layout_map[key] = value
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(distribution)
    return distribution


def start_worker():
    """One thread; no TensorFlow (Keras's `set_random_seed` imports it when
    installed: seconds and memory a process); this rank's GPU on CUDA."""
    sys.modules.setdefault("tensorflow", None)
    import torch

    torch.set_num_threads(1)
    if cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def write_result(result_dir, result):
    """This rank's result for `launch`, with its peak RSS."""
    rank = int(os.environ.get("RANK", "0"))
    result = dict(result, rank=rank, rss_mb=peak_rss_mb())
    write_json(os.path.join(result_dir, f"rank{rank}.json"), result)


def rounds(count, variants, run):
    """{variant: [run(variant) for each round]}, every other round in
    reverse order."""
    out = {v: [] for v in variants}
    for index in range(count):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            print(f"round {index + 1}: {variant}", flush=True)
            out[variant].append(run(variant))
    return out


def per_round(a, b, op=lambda x, y: x / y):
    """`op` of two variants' figures within each round, and its median."""
    values = [op(x, y) for x, y in zip(a, b, strict=True)]
    return values, statistics.median(values)


def cuda():
    return os.environ.get("BENCH_DEVICE") == "cuda"


def sync():
    """Waits for queued GPU work, so a timed call is the call's own."""
    if cuda():
        import torch

        torch.cuda.synchronize()


def status():
    """VmRSS and VmHWM of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_peak():
    """Resets VmHWM to the current RSS (Linux `clear_refs`, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def record(command, **fields):
    """A results entry: today's date, the commit measured, the command."""
    git = ["git", "rev-parse", "--short", "HEAD"]
    done = subprocess.run(git, capture_output=True, text=True, cwd=HERE)
    today = datetime.date.today().isoformat()
    entry = {"date": today, "commit": done.stdout.strip(), "command": command}
    return {**entry, **fields}


def dir_bytes(path):
    """The bytes of a file, or of every file under a folder."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def write_json(path, data, sort_keys=False):
    """`data` as JSON into `path`; without one, printed."""
    text = json.dumps(data, indent=1, ensure_ascii=False, sort_keys=sort_keys)
    if not path:
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")


def update_results(path, key, rows):
    """Puts `rows` under `key` of the results file at `path`, dated, with
    the commit measured (the file's other keys are kept)."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[key] = record(" ".join(["python", *sys.argv]), rows=rows)
    write_json(path, data, sort_keys=True)  # as the file has always been
