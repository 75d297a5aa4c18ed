"""`jit_compile=True` with nothing distributed: plain Keras against the same
program with `import keras_dtensor` first, compile time included.

    python benchmarks/bench_jit_no_dist.py --rounds 2 [--out OUT]
"""

import statistics
import tempfile

import bench_harness as harness

VARIANTS = ("plain", "kd")


def worker(variant, result_dir):
    import time

    import keras
    import numpy as np

    if variant == "kd":
        import keras_dtensor  # noqa: F401

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 32)).astype("float32")
    y = rng.normal(size=(256, 4)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,))]
        + [keras.layers.Dense(64, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(4)]
    )
    start = time.perf_counter(), time.process_time()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    model.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, verbose=0)
    model.evaluate(x, y, batch_size=32, verbose=0)
    model.predict(x, batch_size=32, verbose=0)
    wall = time.perf_counter() - start[0]
    cpu = time.process_time() - start[1]
    harness.write_result(result_dir, {"wall": wall, "cpu": cpu})


def main(argv=None):
    parser = harness.parser(__doc__, rounds=2)
    parser.add_argument("--variant", choices=VARIANTS)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args.variant, args.result_dir)

    def run(variant):  # a cold run, then a warm one on its cache
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache}
            flags = [f"--variant={variant}"]
            runs = [harness.launch(__file__, 0, flags, env) for _ in range(2)]
        return [ranks[0]["wall"] for ranks in runs]

    seconds = harness.rounds(args.rounds, VARIANTS, run)
    rows = []
    for i, cache in enumerate(("cold", "warm")):
        plain, kd = ([took[i] for took in seconds[v]] for v in VARIANTS)
        ratios, ratio = harness.per_round(kd, plain)
        row = {"cache": cache, "plain_s": statistics.median(plain)}
        row["kd_s"] = statistics.median(kd)
        rows.append(dict(row, ratio=[ratio, min(ratios), max(ratios)]))
    command = f"python benchmarks/bench_jit_no_dist.py --rounds {args.rounds}"
    record = harness.record(command, rounds=args.rounds, rows=rows)
    harness.write_json(args.out, record)


if __name__ == "__main__":
    main()
