"""What keras-dtensor costs where it should cost (almost) nothing.

Plain Keras against the same program with `import keras_dtensor` and no
distribution, and against distributions over one device (no torchrun):

    python benchmarks/bench_no_dist.py --rounds 4 --steps 40

(about 5 minutes on 2 shared cores; `--models`, `--variants`, `--methods`
and `--import-rounds 0` run a part of it).

Variants, each run in a fresh process with one thread:

- `plain`: Keras alone; keras_dtensor is never imported.
- `kd`: `import keras_dtensor` first, no distribution set.
- `kd_dp1`: `DataParallel` over the one device (world size 1).
- `kd_mp1`: `ModelParallel` over a 1 x 1 ("batch", "model") mesh, the
  weight matrices laid out over "model" (a one-device "sharding").

Models: MLP 4 x Dense(256) (`--mlp-width`), batch 64; transformer 2
blocks, d_model 128, 4 heads (attention dropout 0.1, so every train step
draws seeds), MLP 256, seq 32, batch 16. Adam, fp32, MSE on random targets.

Per process and model: `fit` over `--steps` batches after `--warmup`, as
many `train_on_batch` calls, and `predict` over as many batches. A step is
the interval between consecutive batch-begin callbacks (`fit`, `predict`:
a callback with no batch-end method keeps Keras's asynchronous batch-end
dispatch, as in a plain `fit`) or one call (`train_on_batch`), in wall time
and in the process's CPU time (which leaves out waiting for a core while
other jobs share the machine); the process's figure is the median over its
steps. Also printed: minor page faults per step. glibc malloc's mmap and
trim thresholds adapt to each process's allocation history, so some
processes hand multi-megabyte buffers back to the OS after every step and
fault them in again: at width 1024, 1,000 to 18,000 faults per step and up
to ~40% of the step, varying from process to process whatever is imported.
`--fixed-malloc` pins the thresholds in every worker (both sides of every
ratio alike), which takes that out of the comparison.

The variants of a model run back to back, in reverse order every other
round, and each ratio to `plain` is taken within its round (this machine's
speed drifts by more than the margins checked). Printed: ms/step min /
median / max over rounds, and the per-round ratios' min / median / max.
Targets (issue #18): `kd` <= 1.03 x plain, `kd_dp1` and `kd_mp1` <= 1.05 x.

`hooks` mode (`python benchmarks/bench_no_dist.py hooks`): what the
hooks cost per step, without the process-to-process noise of the A/B
above. One process per model imports keras_dtensor, then alternates
blocks of `--steps` `train_on_batch` and `predict_on_batch` calls with
the hooks installed and uninstalled (`keras_dtensor.uninstall()`),
`--rounds` pairs, in alternating order; printed: the median ms per call
of each side and the median of the paired ratios.

Import time, fresh `python -c` processes, alternating, wall and CPU
seconds: `import keras`, `import keras_dtensor` and `import keras; import
torch.distributed.tensor` (against `import keras`), `import torch; import
torch.distributed.tensor` (against `import torch`). Keras's torch backend
already imports DTensor (keras.src.backend.torch.image -> torch._dynamo ->
... -> torch.distributed.fsdp -> torch.distributed.tensor), so the third
costs what `import keras` does; the last is DTensor's own import cost.
Each is also timed inside its process after its setup (`import keras;
import keras_dtensor`: what the package itself adds).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# The models and the TP layout of the step benchmark (run as scripts from
# benchmarks/, so the sibling module is importable).
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
_MARK = "BENCH_RESULT "


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
    """The `hooks` mode (see the module docstring), in this process."""
    import torch

    torch.set_num_threads(1)
    lines = [
        "| model | method | hooks on ms | uninstalled ms | on / off "
        "(median of paired blocks) |",
        "|---|---|---|---|---|",
    ]
    for model_name in args.models.split(","):
        result = _hooks_one(model_name, args.steps, args.rounds)
        for method, r in result.items():
            lines.append(
                f"| {model_name} | {method} | {r['on']:.3f} | {r['off']:.3f} "
                f"| {r['ratio']:.3f} |"
            )
    print("\n".join(lines))
    return 0


def worker(args):
    # A torch-only environment: Keras's set_random_seed imports TensorFlow
    # whenever it is installed (the test setup installs it for tf.data).
    sys.modules.setdefault("tensorflow", None)
    import torch

    torch.set_num_threads(1)
    methods = args.methods.split(",")
    result = _run(args.variant, args.model, args.steps, args.warmup, methods)
    print(_MARK + json.dumps(result), flush=True)


# glibc malloc's thresholds adapt to the process's history: some
# processes give multi-megabyte buffers back to the OS after every step and
# fault them in again (thousands of page faults per step at width 1024),
# others keep them. Fixed thresholds take that out of an A/B.
_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}


def _env(fixed_malloc=False):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        KERAS_BACKEND="torch",
        CUDA_VISIBLE_DEVICES="",
    )
    if fixed_malloc:
        env.update(_MALLOC_ENV)
    return env


def _launch(variant, model, args):
    command = [
        sys.executable,
        __file__,
        "worker",
        f"--variant={variant}",
        f"--model={model}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--methods={args.methods}",
        f"--mlp-width={args.mlp_width}",
    ]
    env = _env(args.fixed_malloc)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(name, None)  # one process, no torchrun
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant}/{model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_MARK) :])


# ---------------------------------------------------------------- import
def _import_seconds(setup, statement):
    """Wall and CPU (user + system) seconds of one fresh `python -c`, and
    the seconds its last statement took inside it."""
    code = (
        f"import time\n{setup}\nstart = time.perf_counter()\n{statement}\n"
        "print(time.perf_counter() - start)"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=_env(),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (
        after.ru_stime - before.ru_stime
    )
    return wall, cpu, float(proc.stdout.split()[-1])


def import_times(rounds):
    """Per import command: [wall, CPU, timed statement] seconds, over
    alternating fresh processes."""
    names = list(IMPORTS)
    times = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(_import_seconds(*IMPORTS[name]))
    return times


# ---------------------------------------------------------------- report
def _spread(values, fmt="{:.2f}"):
    return " / ".join(
        fmt.format(v)
        for v in (min(values), statistics.median(values), max(values))
    )


def _ratios(values, baseline):
    return [a / b for a, b in zip(values, baseline, strict=True)]


def _step_table(raw, variants, methods):
    lines = [
        "ms/step: min / median / max over rounds (each round: the median "
        "over its steps). Ratio: to plain in the same round, min / median "
        "/ max over rounds. CPU: the process's CPU time per step, which "
        "leaves out time spent waiting for a core on a shared machine. Faults: "
        "minor page faults per step (memory the allocator gave back to the "
        "OS and touches again), min / median / max over rounds.",
        "",
        "| model | method | variant | wall ms | wall ratio | CPU ms | "
        "CPU ratio | target (median ratio, wall / CPU) | faults/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for model, rows in raw.items():
        for method in methods:
            plain = rows.get("plain", [])
            for variant in variants:
                wall = [r[method][0] for r in rows[variant]]
                cpu = [r[method][1] for r in rows[variant]]
                faults = [r[method][2] for r in rows[variant]]
                entry = {"wall_ms": wall, "cpu_ms": cpu, "faults": faults}
                cells = ["-", "-", "-"]
                if variant != "plain" and plain:
                    entry["wall_ratios"] = _ratios(
                        wall, [r[method][0] for r in plain]
                    )
                    entry["cpu_ratios"] = _ratios(
                        cpu, [r[method][1] for r in plain]
                    )
                    limit = TARGETS[variant]
                    held = [
                        "held"
                        if statistics.median(entry[k]) <= limit
                        else "MISSED"
                        for k in ("wall_ratios", "cpu_ratios")
                    ]
                    cells = [
                        _spread(entry["wall_ratios"], "{:.3f}"),
                        _spread(entry["cpu_ratios"], "{:.3f}"),
                        f"<= {limit}: {held[0]} / {held[1]}",
                    ]
                summary.setdefault(model, {}).setdefault(method, {})[
                    variant
                ] = entry
                lines.append(
                    f"| {model} | {method} | {variant} | {_spread(wall)} | "
                    f"{cells[0]} | {_spread(cpu)} | {cells[1]} | {cells[2]} | "
                    f"{_spread(faults, '{:.0f}')} |"
                )
    return lines, summary


def _import_table(imports):
    lines = [
        "",
        "Import: seconds per fresh process, min / median / max; extra: "
        "median over rounds of the difference to the reference in the same "
        "round; last column: the statement alone, timed inside the process "
        "after the setup, median.",
        "",
        "| setup; statement | wall s | CPU s | extra wall s | extra CPU s "
        "| over | statement alone, ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, values in imports.items():
        reference = "torch" if name.startswith("torch") else "keras"
        cells = []
        for i in (0, 1):
            extra = [
                a[i] - b[i]
                for a, b in zip(values, imports[reference], strict=True)
            ]
            cells.append(f"{statistics.median(extra):+.3f}")
        setup, statement = IMPORTS[name]
        command = f"{setup}; {statement}" if setup else statement
        alone = 1000 * statistics.median(v[2] for v in values)
        lines.append(
            f"| `{command}` | {_spread([v[0] for v in values])} | "
            f"{_spread([v[1] for v in values])} | {cells[0]} | {cells[1]} | "
            f"`{IMPORTS[reference][1]}` | {alone:.1f} |"
        )
    return lines


def _report(raw, variants, methods, imports):
    lines, summary = _step_table(raw, variants, methods)
    if imports:
        lines += _import_table(imports)
    return "\n".join(lines), summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "mode",
        nargs="?",
        default="bench",
        choices=["bench", "worker", "hooks"],
    )
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--import-rounds",
        type=int,
        default=4,
        help="rounds of the import-time comparison (0: skip it)",
    )
    parser.add_argument(
        "--mlp-width",
        type=int,
        default=MODELS["mlp"]["width"],
        help="the MLP's width (issue #18 also quotes 1024)",
    )
    parser.add_argument(
        "--fixed-malloc",
        action="store_true",
        help="fixed glibc malloc thresholds in every worker (see _MALLOC_ENV)",
    )
    parser.add_argument("--out", default=None, help="write raw JSON here")
    args = parser.parse_args(argv)
    MODELS["mlp"]["width"] = args.mlp_width
    if args.mode == "worker":
        return worker(args)
    if args.mode == "hooks":
        return hooks(args)

    models = args.models.split(",")
    methods = [m for m in METHODS if m in args.methods.split(",")]
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    unknown |= set(models) - MODELS.keys()
    unknown |= set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    started = time.time()
    raw = {m: {v: [] for v in variants} for m in models}
    for round_index in range(args.rounds):
        # Odd rounds run the variants in reverse, so no variant always
        # runs first or next to the same neighbour.
        order = variants if round_index % 2 == 0 else variants[::-1]
        for model in models:
            for variant in order:
                result = _launch(variant, model, args)
                raw[model][variant].append(result)
                figures = " ".join(
                    f"{m} {result[m][0]:6.2f} ({result[m][1]:6.2f} CPU, "
                    f"{result[m][2]:.0f} faults)"
                    for m in methods
                )
                print(
                    f"round {round_index + 1} {model:11} {variant:7} "
                    f"{figures} ms ({'/'.join(result['variable_types'])})",
                    flush=True,
                )
    imports = None
    if args.import_rounds:
        imports = import_times(args.import_rounds)
    text, summary = _report(raw, variants, methods, imports)
    print(text)
    print(f"\n{time.time() - started:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "table": summary,
                    "imports": imports,
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "mlp_width": args.mlp_width,
                    "fixed_malloc": args.fixed_malloc,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
