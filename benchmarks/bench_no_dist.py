"""What keras-dtensor costs where it should cost (almost) nothing.

    python benchmarks/bench_no_dist.py --rounds 4 --steps 40

Plain Keras against the same program with `import keras_dtensor` and no
distribution, and with a one-device distribution (`VARIANTS`); ratios to
`plain` within each round.
"""

import resource
import statistics
import sys
import time

import bench_harness as harness
from bench_step import _keras_layouts
from bench_step import _keras_model

VARIANTS = ("plain", "kd", "kd_dp1", "kd_mp1")
METHODS = ("fit", "train_on_batch", "predict")
MODELS = {
    "mlp": dict(width=256, layers=4, batch=64),
    "transformer": dict(
        d_model=128, heads=4, mlp=256, seq=32, batch=16, blocks=2, dropout=0.1
    ),
}


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


def _run(variant, model_name, steps, warmup):
    if variant != "plain":
        import keras_dtensor  # noqa: F401
    import keras
    import numpy as np

    if variant == "kd_dp1":
        distribution = keras.distribution.DataParallel()
        keras.distribution.set_distribution(distribution)
    elif variant == "kd_mp1":
        layouts = _keras_layouts(model_name, "kd_mp")
        harness.model_parallel(keras, layouts, (1, 1))
    keras.utils.set_random_seed(0)
    cfg = MODELS[model_name]
    model = _keras_model(keras, model_name, cfg)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    rng = np.random.default_rng(0)
    batch = cfg["batch"]
    n = warmup + steps + 1  # intervals between n batch begins: n - 1
    shape = (n * batch, *model.input_shape[1:])
    x, y = (rng.standard_normal(shape, dtype=np.float32) for _ in "xy")

    class Begins(keras.callbacks.Callback):
        # Only batch-begin methods: Keras keeps dispatching batch ends
        # asynchronously, as in a fit without callbacks.
        def __init__(self):
            super().__init__()
            self.t = []

        def on_train_batch_begin(self, batch, logs=None):
            self.t.append(_clocks())

        on_predict_batch_begin = on_train_batch_begin

    begins = Begins()
    fit = dict(batch_size=batch, shuffle=False, verbose=0, callbacks=[begins])
    model.fit(x, y, **fit)
    result = {"fit": _per_step(begins.t, warmup)}
    stamps = [_clocks()]
    for i in range(warmup + steps):
        rows = slice(i * batch, (i + 1) * batch)
        model.train_on_batch(x[rows], y[rows])
        stamps.append(_clocks())
    result["train_on_batch"] = _per_step(stamps, warmup)
    begins = Begins()
    model.predict(x, batch_size=batch, verbose=0, callbacks=[begins])
    result["predict"] = _per_step(begins.t, warmup)
    kinds = {type(v.value).__name__ for v in model.trainable_variables}
    result["variable_types"] = sorted(kinds)
    return result


def worker(args):
    harness.start_worker()
    result = _run(args.variant, args.model, args.steps, args.warmup)
    harness.write_result(args.result_dir, result)


# Fixed thresholds take glibc's per-process adaptation out of an A/B.
_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}


def _summary(runs):
    """Per method: each variant's medians over rounds (wall, CPU ms,
    faults) and its per-round wall and CPU ratios to plain."""
    out = {}
    for method in METHODS:
        for variant, results in runs.items():
            figures = [[r[method][i] for r in results] for i in (0, 1, 2)]
            entry = {"wall_ms": figures[0], "cpu_ms": figures[1]}
            entry["faults"] = figures[2]
            if variant != "plain" and "plain" in runs:
                for i, key in enumerate(("wall_ratios", "cpu_ratios")):
                    plain = [r[method][i] for r in runs["plain"]]
                    entry[key] = harness.per_round(figures[i], plain)[0]
            out.setdefault(method, {})[variant] = entry
    return out


def main(argv=None):
    parser = harness.parser(__doc__, rounds=4)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--fixed-malloc", action="store_true")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    env = _MALLOC_ENV if args.fixed_malloc else {}
    flags = [f"--steps={args.steps}", f"--warmup={args.warmup}"]
    models = args.models.split(",")

    def run(pair):
        flag = [f"--variant={pair[1]}", f"--model={pair[0]}", *flags]
        return harness.launch(__file__, 0, flag, env)[0]

    pairs = [(model, variant) for model in models for variant in variants]
    runs = harness.rounds(args.rounds, pairs, run)
    table = {m: _summary({v: runs[m, v] for v in variants}) for m in models}
    result = {"table": table, "rounds": args.rounds, "steps": args.steps}
    result["fixed_malloc"] = args.fixed_malloc
    harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
