"""Time from SIGTERM to exit: does the save fit a grace period?

    python benchmarks/bench_preemption.py \\
        --out benchmarks/results-preemption.json

Each case (`CASES`) trains with `ShardedCheckpoint` in `fit` until the
whole job gets SIGTERM, as a cluster sends it; the job then restarts, and
the step it resumes at gives the steps lost.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import bench_harness as harness
import bench_step

CASES = {
    "transformer": dict(nproc=2),
    "mlp": dict(nproc=2),
    "mlp_1g": dict(nproc=4, width=8192, layers=4, batch=8),
}


def worker(args):
    import keras
    import numpy as np

    import keras_dtensor
    from keras_dtensor.backend import launch

    keras.distribution.list_devices()  # starts the group
    _, rank = launch.world()
    name = "mlp" if args.case == "mlp_1g" else args.case  # the MLP, wider
    cfg = bench_step.MODELS.get(args.case, CASES[args.case])
    harness.model_parallel(keras, bench_step._keras_layouts(name, "kd_tp"))
    keras.utils.set_random_seed(0)
    model = bench_step._keras_model(keras, name, cfg)
    model.compile(optimizer="adam", loss="mse")
    batch = cfg["batch"]
    shape = (cfg["width"],) if name == "mlp" else (cfg["seq"], cfg["d_model"])
    x = np.random.default_rng(0).normal(size=(batch * 16, *shape))
    x = x.astype("float32")

    class Mark(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            done = int(
                keras.ops.convert_to_numpy(self.model.optimizer.iterations)
            )
            if rank == 0:
                with open(os.path.join(args.root, "steps.txt"), "a") as f:
                    f.write(f"{done}\n")

    callbacks = [keras_dtensor.ShardedCheckpoint(args.root + "/ckpt"), Mark()]
    try:
        model.fit(
            x, x, batch_size=batch, epochs=1000, verbose=0, callbacks=callbacks
        )
    except SystemExit as e:
        with open(os.path.join(args.root, f"exit-{rank}.txt"), "w") as f:
            f.write(f"{e.code} {time.time()}")
        raise


def _steps(root):
    with open(os.path.join(root, "steps.txt")) as f:
        return [int(line) for line in f]


def _job(case, root, signal_after_steps=None):
    env = dict(os.environ, **harness.ENV)
    command = [*harness.TORCHRUN, f"--nproc_per_node={CASES[case]['nproc']}"]
    command += [os.path.abspath(__file__), "--worker", f"--case={case}"]
    command.append(f"--root={root}")
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    steps = os.path.join(root, "steps.txt")
    while proc.poll() is None:
        if os.path.exists(steps) and len(_steps(root)) > signal_after_steps:
            break
        time.sleep(0.01)
    sent, sent_wall = time.monotonic(), time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=900)
    return time.monotonic() - sent, sent_wall, err


def measure(case):
    nproc = CASES[case]["nproc"]
    with tempfile.TemporaryDirectory() as root:
        exit_s, sent, err = _job(case, root, signal_after_steps=10)
        found = re.search(r"checkpoint in .* \(([0-9.]+) s\)", err)
        exits = [
            open(os.path.join(root, f"exit-{r}.txt")).read().split()
            for r in range(nproc)
            if os.path.exists(os.path.join(root, f"exit-{r}.txt"))
        ]
        codes = {code for code, _ in exits}
        saved_s = max(float(t) for _, t in exits) - sent if exits else None
        before = _steps(root)
        checkpoint = harness.dir_bytes(os.path.join(root, "ckpt"))
        # Started again: where does it resume?
        _job(case, root, signal_after_steps=len(before) + 1)
        after = _steps(root)[len(before)]
    return {
        "case": case,
        "processes": nproc,
        "signal_to_exit_s": round(exit_s, 2),
        "signal_to_saved_s": round(saved_s, 2) if exits else None,
        "save_s": float(found.group(1)) if found else None,
        "checkpoint_mib": round(checkpoint / 2**20, 1),
        "exit_codes": sorted(codes),
        "steps_lost": before[-1] + 1 - after,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--case")
    parser.add_argument("--root")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = [measure(case) for case in args.cases.split(",")]
    if args.out:
        harness.update_results(args.out, "signal_to_exit", rows)


if __name__ == "__main__":
    sys.exit(main())
