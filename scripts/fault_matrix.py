"""Faults, measured: callbacks on a fresh directory, a rank SIGKILLed
mid-epoch under `torchrun --max-restarts=1`, repeated.

    python scripts/fault_matrix.py --runs 20

For each strategy, one uninterrupted job gives the reference weights; each
run then starts `scripts/fault_worker.py` on 2 processes in a fresh
directory, rank 1 kills itself in epoch 3, torchrun restarts the job, and
BackupAndRestore resumes it. A run survives when the job exits 0, its final
weights equal the reference bit for bit, and the files are those of one
process (checkpoints for epochs 1-4, best.keras, log.csv with 4 epochs, no
backup left, no temporary files). Then the same with `ShardedCheckpoint`
(every epoch, keep 2) and rank 1 killed at a random moment of `fit`
(`--sharded-runs`), sometimes in the middle of a save: it survives when
it resumes from the newest complete checkpoint to the same weights and
files.
Prints a markdown table.
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fault_worker.py")


def _job(root, strategy, kill, callbacks="keras", kill_after=None):
    env = dict(
        os.environ,
        ROOT=root,
        STRATEGY=strategy,
        CALLBACKS=callbacks,
        OMP_NUM_THREADS="1",
        KERAS_BACKEND="torch",
    )
    env.pop("PYTHONHASHSEED", None)
    if kill:
        env["KILL_RANK"] = "1"
    if kill_after is not None:
        env["KILL_AFTER"] = f"{kill_after:.3f}"
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            WORKER,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, time.monotonic() - start


def _files(root):
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root)
            found.append(rel.split(".out.tfevents.")[0])
    return sorted(found)


def _weights(root):
    with np.load(os.path.join(root, "final.npz")) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sharded-runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    rows = []
    strategies = ("model_parallel", "data_parallel")
    cases = [(s, "keras", args.runs) for s in strategies]
    cases += [(s, "sharded", args.sharded_runs) for s in strategies]
    for strategy, callbacks, runs in cases:
        if not runs:
            continue
        with tempfile.TemporaryDirectory() as root:
            proc, _ = _job(root, strategy, kill=False, callbacks=callbacks)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            reference = _weights(root)
            with open(os.path.join(root, "fit_seconds.txt")) as f:
                fit_seconds = float(f.read())
            expected = [f for f in _files(root) if not f.startswith("tb")]
        survived, seconds, lost = 0, [], 0
        for run in range(runs):
            kill_after = None
            if callbacks == "sharded":
                kill_after = random.uniform(0.0, fit_seconds)
            with tempfile.TemporaryDirectory() as root:
                proc, elapsed = _job(
                    root, strategy, True, callbacks, kill_after=kill_after
                )
                seconds.append(elapsed)
                ok = proc.returncode == 0 and os.path.exists(
                    os.path.join(root, "final.npz")
                )
                if ok:
                    same = all(
                        np.array_equal(a, b)
                        for a, b in zip(_weights(root), reference, strict=True)
                    )
                    files = [f for f in _files(root) if not f.startswith("tb")]
                    ok = same and files == expected
                    lost += not same
                survived += ok
                if not ok:
                    print(f"run {run} {strategy}: rc={proc.returncode}")
                    print(proc.stderr[-2000:])
        rows.append(
            (strategy, callbacks, runs, survived, np.median(seconds), lost)
        )
    print("| fault | runs | survived | job time (median s) | data lost |")
    print("|---|---|---|---|---|")
    for strategy, callbacks, runs, survived, median, lost in rows:
        fault = (
            "mid-epoch 3, 5 Keras callbacks"
            if callbacks == "keras"
            else "at a random moment, ShardedCheckpoint every epoch"
        )
        print(
            f"| rank 1 SIGKILLed {fault}, {strategy}, fresh dir, "
            f"--max-restarts=1 | {runs} | {survived} | {median:.1f} | "
            f"{lost} |"
        )


if __name__ == "__main__":
    main()
