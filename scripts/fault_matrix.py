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

`--preemption-runs N` (the faults of preemptible machines; shuffled data,
`ShardedCheckpoint` every 4 batches, keep 2), each N times for both
strategies:

- SIGTERM to the whole job (torchrun and its workers, as a cluster
  does) at a random moment of `fit` (a step, a collective, a save); the
  job is then started again. Survives when every worker exited 75, the
  second job ends with the uninterrupted job's weights bit for bit, and
  no step is trained twice (data lost: steps redone; must be 0);
- rank 1 SIGKILLed inside a sharded save (before or after writing its
  shards), `--max-restarts=1`: data lost at most the 4 batches since
  the checkpoint before;
- rank 1 stalling 2x a step every 5 steps: the job finishes, same
  weights;
- rank 1's disk full inside a save: every rank raises, the checkpoint
  before loads.

Prints markdown tables; `--json PATH` also writes the rows.
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fault_worker.py")


def _job(
    root,
    strategy,
    kill,
    callbacks="keras",
    kill_after=None,
    extra_env=None,
    restarts=1,
    signal_after=None,
):
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
    env.update(extra_env or {})
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        WORKER,
    ]
    start = time.monotonic()
    if signal_after is None:
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=600
        )
        return proc, time.monotonic() - start
    # A cluster's SIGTERM: to the launcher and its workers at once, once
    # fit has run `signal_after` seconds (its first step logged).
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    events = os.path.join(root, "events.txt")
    while not os.path.exists(events) and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(signal_after)
    sent = time.time()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    proc = subprocess.CompletedProcess(command, proc.returncode, out, err)
    proc.signal_sent, proc.exit_s = sent, time.time() - sent
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


def _steps(root):
    """The optimizer step count at each step's start, in log order."""
    with open(os.path.join(root, "events.txt")) as f:
        return [int(line.split()[1]) for line in f if line.startswith("step")]


def _redone(root):
    """Steps trained twice: where the log goes back after a restart."""
    steps = _steps(root)
    return max(
        [0] + [a + 1 - b for a, b in zip(steps, steps[1:], strict=False)]
    )


def _in_save(root, moment):
    with open(os.path.join(root, "events.txt")) as f:
        marks = [line.split() for line in f if line.startswith("save")]
    starts = [float(t) for kind, t in marks if kind == "save_start"]
    ends = [float(t) for kind, t in marks if kind == "save_end"]
    return any(a <= moment <= b for a, b in zip(starts, ends, strict=False))


def _no_leftovers(root):
    sharded = os.path.join(root, "sharded")
    return all(name.startswith("ckpt-") for name in os.listdir(sharded))


def _read(root, name):
    path = os.path.join(root, name)
    return open(path).read() if os.path.exists(path) else None


def _preemption_run(fault, strategy, reference, fit_seconds):
    """One run of `fault`; returns (survived, steps redone, seconds to
    recover, detail)."""
    env = {"FAULT": fault}
    with tempfile.TemporaryDirectory() as root:
        if fault == "sigterm":
            first, t1 = _job(
                root,
                strategy,
                False,
                "preempt",
                extra_env=env,
                restarts=0,
                signal_after=random.uniform(0.0, fit_seconds),
            )
            where = "save" if _in_save(root, first.signal_sent) else "step"
            codes = {_read(root, f"exit-{r}.txt") for r in (0, 1)}
            finished = os.path.exists(os.path.join(root, "final.npz"))
            ok = finished or codes == {"75"}
            seconds = t1
            if not finished:
                second, t2 = _job(root, strategy, False, "preempt", restarts=0)
                ok = ok and second.returncode == 0
                seconds += t2
            detail = (where, first.exit_s)
        else:
            if fault == "stall":
                env["STALL_S"] = f"{2 * fit_seconds / 64:.3f}"
            else:
                env["SAVE_INDEX"] = str(random.randint(2, 14))
                env["WHEN"] = random.choice(("before", "after"))
            proc, seconds = _job(
                root,
                strategy,
                False,
                "preempt",
                extra_env=env,
                restarts=0 if fault == "full_disk" else 1,
            )
            ok = proc.returncode == 0
            detail = (env.get("WHEN"), None)
            if not ok:
                print(proc.stderr[-2000:])
        if fault == "full_disk":
            raised = [_read(root, f"raised-{r}.txt") for r in (0, 1)]
            intact = [_read(root, f"intact-{r}.txt") for r in (0, 1)]
            ok = ok and all(raised) and all(intact) and _no_leftovers(root)
            return ok, None, seconds, detail
        same = ok and all(
            np.array_equal(a, b)
            for a, b in zip(_weights(root), reference, strict=True)
        )
        redone = _redone(root)
        ok = same and _no_leftovers(root)
        if fault in ("sigterm", "stall"):
            ok = ok and redone == 0
        return ok, redone, seconds, detail


FAULTS = {
    "sigterm": "SIGTERM to the job at a random moment, then restarted",
    "sigkill_save": "rank 1 SIGKILLed inside a sharded save, --max-restarts=1",
    "stall": "rank 1 stalls 2x a step every 5 steps",
    "full_disk": "rank 1's disk full inside a sharded save",
}


def _preemption(runs):
    rows = []
    for strategy in ("model_parallel", "data_parallel"):
        with tempfile.TemporaryDirectory() as root:
            proc, job_s = _job(root, strategy, False, "preempt")
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            reference = _weights(root)
            fit_seconds = float(_read(root, "fit_seconds.txt"))
        for fault, what in FAULTS.items():
            results = [
                _preemption_run(fault, strategy, reference, fit_seconds)
                for _ in range(runs)
            ]
            lost = [r[1] for r in results if r[1] is not None]
            exits = [r[3][1] for r in results if r[3][1] is not None]
            rows.append(
                {
                    "fault": f"{what}, {strategy}",
                    "runs": runs,
                    "survived": sum(r[0] for r in results),
                    "steps_lost_max": max(lost) if lost else None,
                    # A full disk raises by design: nothing to recover.
                    "recover_s_median": None
                    if fault == "full_disk"
                    else round(
                        float(np.median([r[2] for r in results])) - job_s, 1
                    ),
                    "signal_to_exit_s_median": (
                        round(float(np.median(exits)), 2) if exits else None
                    ),
                    "signal_to_exit_s_max": (
                        round(max(exits), 2) if exits else None
                    ),
                    "signals_during_a_save": sum(
                        r[3][0] == "save" for r in results
                    ),
                }
            )
            print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sharded-runs", type=int, default=10)
    parser.add_argument("--preemption-runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    random.seed(args.seed)
    preempted = (
        _preemption(args.preemption_runs) if args.preemption_runs else []
    )
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
    if preempted:
        print()
        print("| fault | runs | survived | steps lost (max) | recover s |")
        print("|---|---|---|---|---|")
        for row in preempted:
            print(
                f"| {row['fault']} | {row['runs']} | {row['survived']} | "
                f"{row['steps_lost_max']} | {row['recover_s_median']} |"
            )
    if args.json and preempted:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
        from bench_harness import update_results

        update_results(args.json, "fault_matrix", preempted)


if __name__ == "__main__":
    main()
