"""What keras-dtensor costs where it should cost (almost) nothing.

    python benchmarks/bench_no_dist.py --rounds 4 --steps 40
    python benchmarks/bench_no_dist.py hooks --rounds 12 --steps 50

Plain Keras (`plain`) against the same program with `import
keras_dtensor` and no distribution (`kd`), `DataParallel` over one device
(`kd_dp1`) and `ModelParallel` on a 1 x 1 mesh (`kd_mp1`), each in a
fresh process with one thread, alternating round by round; each ratio to
`plain` is taken within its round. Models: MLP 4 x Dense(256), batch 64;
transformer 2 blocks, d_model 128 (attention dropout, so every step draws
seeds), batch 16. Per process: `fit`, `train_on_batch` and `predict`, ms
a step in wall and CPU time and minor page faults a step (medians).
`--fixed-malloc` pins glibc's mmap and trim thresholds in every worker,
which otherwise adapt per process and add page faults that differ from
process to process. Targets (issue 18): `kd` <= 1.03 x plain, the others
<= 1.05 x.

`hooks`: one process per model alternates blocks of `train_on_batch` and
`predict_on_batch` calls with the hooks installed and uninstalled
(`keras_dtensor.uninstall()`). Import times (`--import-rounds`): fresh
`python -c` processes, alternating, wall and CPU seconds of each import
and of its last statement timed inside the process.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import bench_harness as harness
from bench_step import _keras_layouts
from bench_step import _keras_model

VARIANTS = ("plain", "kd", "kd_dp1", "kd_mp1")
METHODS = ("fit", "train_on_batch", "predict")
TARGETS = {"kd": 1.03, "kd_dp1": 1.05, "kd_mp1": 1.05}
MODELS = {
    "mlp": dict(width=256, layers=4, batch=64),
    "transformer": dict(
        d_model=128, heads=4, mlp=256, seq=32, batch=16, blocks=2, dropout=0.1
    ),
}
# name: (untimed setup, statement timed inside the process too)
IMPORTS = {
    "keras": ("", "import keras"),
    "keras_dtensor": ("", "import keras_dtensor"),
    "keras+keras_dtensor": ("import keras", "import keras_dtensor"),
    "keras+dtensor": ("import keras", "import torch.distributed.tensor"),
    "torch": ("", "import torch"),
    "torch+dtensor": ("import torch", "import torch.distributed.tensor"),
}


# ---------------------------------------------------------------- worker
def _set_distribution(keras, variant, model_name):
    if variant == "kd_dp1":
        distribution = keras.distribution.DataParallel()
    else:
        mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in _keras_layouts(model_name, "kd_mp").items():
            layout_map[key] = axes
        distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(distribution)


def _clocks():
    """Wall and process CPU seconds, and minor page faults so far."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return time.perf_counter(), time.process_time(), faults


def _per_step(stamps, warmup):
    """Median wall and CPU ms per step (between consecutive stamps, after
    warmup), and the mean minor page faults per step."""
    stamps = stamps[warmup:]
    steps = list(zip(stamps, stamps[1:], strict=False))
    wall, cpu = (
        1000 * statistics.median(b[i] - a[i] for a, b in steps) for i in (0, 1)
    )
    return [wall, cpu, (stamps[-1][2] - stamps[0][2]) / len(steps)]


def _run(variant, model_name, steps, warmup, methods):
    if variant != "plain":
        import keras_dtensor  # noqa: F401
    import keras
    import numpy as np

    if variant in ("kd_dp1", "kd_mp1"):
        _set_distribution(keras, variant, model_name)
    keras.utils.set_random_seed(0)
    cfg = MODELS[model_name]
    model = _keras_model(keras, model_name, cfg)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    rng = np.random.default_rng(0)
    batch = cfg["batch"]
    shape = (batch, *model.input_shape[1:])
    n = warmup + steps + 1  # intervals between n batch begins: n - 1
    x = rng.standard_normal((n * batch, *shape[1:]), dtype=np.float32)
    y = rng.standard_normal((n * batch, *shape[1:]), dtype=np.float32)

    class Begins(keras.callbacks.Callback):
        # Only batch-begin methods: Keras keeps dispatching batch ends
        # asynchronously, as in a fit without callbacks.
        def __init__(self):
            super().__init__()
            self.t = []

        def on_train_batch_begin(self, batch, logs=None):
            self.t.append(_clocks())

        def on_predict_batch_begin(self, batch, logs=None):
            self.t.append(_clocks())

    result = {}
    if "fit" in methods:
        begins = Begins()
        model.fit(
            x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[begins]
        )
        result["fit"] = _per_step(begins.t, warmup)
    if "train_on_batch" in methods:
        stamps = [_clocks()]
        for i in range(warmup + steps):
            rows = slice(i * batch, (i + 1) * batch)
            model.train_on_batch(x[rows], y[rows])
            stamps.append(_clocks())
        result["train_on_batch"] = _per_step(stamps, warmup)
    if "predict" in methods:
        begins = Begins()
        model.predict(x, batch_size=batch, verbose=0, callbacks=[begins])
        result["predict"] = _per_step(begins.t, warmup)
    kinds = {type(v.value).__name__ for v in model.trainable_variables}
    result["variable_types"] = sorted(kinds)
    return result


def _hooks_one(model_name, steps, pairs):
    import keras
    import numpy as np

    import keras_dtensor

    keras.utils.set_random_seed(0)
    cfg = MODELS[model_name]
    model = _keras_model(keras, model_name, cfg)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    shape = (cfg["batch"], *model.input_shape[1:])
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)

    def block(call):
        start = time.perf_counter()
        for _ in range(steps):
            call()
        return 1000 * (time.perf_counter() - start) / steps

    calls = {
        "train_on_batch": lambda: model.train_on_batch(x, x),
        "predict_on_batch": lambda: model.predict_on_batch(x),
    }
    for call in calls.values():
        block(call)  # warm up (and build the train function)
    times = {(m, side): [] for m in calls for side in ("on", "off")}
    for pair in range(pairs):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        for side in order:
            if side == "on":
                keras_dtensor.install()
            else:
                keras_dtensor.uninstall()
            for method, call in calls.items():
                times[(method, side)].append(block(call))
    keras_dtensor.install()
    return {
        method: {
            "on": statistics.median(times[(method, "on")]),
            "off": statistics.median(times[(method, "off")]),
            "ratio": statistics.median(
                a / b
                for a, b in zip(
                    times[(method, "on")], times[(method, "off")], strict=True
                )
            ),
        }
        for method in calls
    }


def hooks(args):
    """The `hooks` mode, in this process."""
    harness.start_worker()
    for model_name in args.models.split(","):
        result = _hooks_one(model_name, args.steps, args.rounds)
        for method, r in result.items():
            print(
                f"{model_name} {method}: on {r['on']:.3f} ms, off "
                f"{r['off']:.3f} ms, on / off {r['ratio']:.3f}"
            )


def worker(args):
    harness.start_worker()
    methods = args.methods.split(",")
    result = _run(args.variant, args.model, args.steps, args.warmup, methods)
    harness.write_result(args.result_dir, result)


# Fixed thresholds take glibc's per-process adaptation out of an A/B.
_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}


def _import_seconds(setup, statement):
    """Wall and CPU seconds of one fresh `python -c`, and the seconds its
    last statement took inside it."""
    code = (
        f"import time\n{setup}\nstart = time.perf_counter()\n{statement}\n"
        "print(time.perf_counter() - start)"
    )
    env = {**os.environ, **harness.ENV, "CUDA_VISIBLE_DEVICES": ""}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, check=True, env=env, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, float(done.stdout.split()[-1])


def _summary(runs, methods):
    """Per method: each variant's medians over rounds (wall, CPU ms,
    faults) and its per-round wall and CPU ratios to plain."""
    out = {}
    for method in methods:
        for variant, results in runs.items():
            figures = [[r[method][i] for r in results] for i in (0, 1, 2)]
            entry = {"wall_ms": figures[0], "cpu_ms": figures[1]}
            entry["faults"] = figures[2]
            if variant != "plain" and "plain" in runs:
                for i, key in enumerate(("wall_ratios", "cpu_ratios")):
                    plain = [r[method][i] for r in runs["plain"]]
                    entry[key] = harness.per_round(figures[i], plain)[0]
                ratio = statistics.median(entry["wall_ratios"])
                print(
                    f"{method} {variant}: wall ratio {ratio:.3f} (target "
                    f"<= {TARGETS[variant]})"
                )
            out.setdefault(method, {})[variant] = entry
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="bench")
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--import-rounds", type=int, default=4, help="0: none")
    parser.add_argument("--mlp-width", type=int, default=256)
    parser.add_argument("--fixed-malloc", action="store_true")
    parser.add_argument("--out", help="write the results JSON here")
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    MODELS["mlp"]["width"] = args.mlp_width
    if args.mode in ("worker", "hooks"):
        return (worker if args.mode == "worker" else hooks)(args)
    methods = [m for m in METHODS if m in args.methods.split(",")]
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    env = _MALLOC_ENV if args.fixed_malloc else {}
    flags = [f"--steps={args.steps}", f"--warmup={args.warmup}"]
    flags += [f"--methods={args.methods}", f"--mlp-width={args.mlp_width}"]
    models = args.models.split(",")

    def run(pair):
        flag = [f"--variant={pair[1]}", f"--model={pair[0]}", *flags]
        return harness.launch(__file__, 0, flag, env)[0]

    def show(index, pair, r):
        ms = " ".join(f"{m} {r[m][0]:.2f} ({r[m][1]:.2f} CPU)" for m in methods)
        return f"round {index} {pair[0]} {pair[1]}: {ms} ms"

    pairs = [(model, variant) for model in models for variant in variants]
    runs = harness.rounds(args.rounds, pairs, run, show)
    table = {
        m: _summary({v: runs[m, v] for v in variants}, methods) for m in models
    }
    names, imports = list(IMPORTS), None
    if args.import_rounds:
        imports = harness.rounds(
            args.import_rounds, names, lambda n: _import_seconds(*IMPORTS[n])
        )
        for name, values in imports.items():
            wall = statistics.median(v[0] for v in values)
            print(f"{name}: {wall:.2f} s a process")
    result = {"table": table, "imports": imports, "rounds": args.rounds}
    result.update(steps=args.steps, fixed_malloc=args.fixed_malloc)
    harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
