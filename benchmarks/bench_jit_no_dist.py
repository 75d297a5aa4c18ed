"""`jit_compile=True` with nothing distributed: plain Keras against the same
program with `import keras_dtensor` first, compile time included.

    python benchmarks/bench_jit_no_dist.py --rounds 2 [--save]

Each run is a fresh process (`bench_harness`): a 3 x Dense(64) MLP,
`compile(jit_compile=True)`, `fit` 2 epochs on 256 rows with
`validation_split=0.25`, `evaluate` and `predict`, timed from `compile` to
the end (tracing and Inductor's code generation included). Each variant
has its own Inductor cache per round: its first run is cold, its second
warm. Variants alternate; ratios are taken within each round. `--save`
writes the record into `results-history.json` (area `zero_cost`, id
`jit-no-dist`). Target (issue 51): within 5% of plain Keras.
"""

import argparse
import json
import os
import statistics
import tempfile

import bench_harness as harness

VARIANTS = ("plain", "kd")
RECORD_ID = "jit-no-dist"
WHAT = (
    "compile time with jit_compile=True, nothing distributed: fit 2 epochs "
    "(256 rows, validation_split 0.25), evaluate and predict of a 3 x "
    "Dense(64) MLP, fresh processes, an Inductor cache per variant and "
    "round (cold: empty, warm: filled by the cold run); median seconds and "
    "per-round kd / plain ratios (min-max)"
)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="bench")
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args.variant, args.result_dir)
    seconds = {(v, c): [] for v in VARIANTS for c in ("cold", "warm")}
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            with tempfile.TemporaryDirectory() as cache:
                for cache_state in ("cold", "warm"):
                    env = {"TORCHINDUCTOR_CACHE_DIR": cache}
                    flags = [f"--variant={variant}"]
                    took = harness.launch(__file__, 0, flags, env)[0]["wall"]
                    seconds[variant, cache_state].append(took)
                    print(
                        f"round {round_} {variant} {cache_state}: {took:.1f} s"
                    )
    rows = []
    for cache in ("cold", "warm"):
        plain, kd = seconds["plain", cache], seconds["kd", cache]
        ratios, ratio = harness.per_round(kd, plain)
        row = {"cache": cache, "plain_s": statistics.median(plain)}
        row["kd_s"] = statistics.median(kd)
        rows.append(dict(row, ratio=[ratio, min(ratios), max(ratios)]))
        print(rows[-1])
    if args.save:
        _save(rows, args.rounds)


def _save(rows, rounds):
    """Puts the record in `results-history.json`'s `zero_cost` area, in
    place of an earlier one."""
    path = os.path.join(harness.HERE, "results-history.json")
    with open(path) as f:
        history = json.load(f)
    command = f"python benchmarks/bench_jit_no_dist.py --rounds {rounds}"
    record = {"id": RECORD_ID, "source": "benchmarks/bench_jit_no_dist.py"}
    record.update(harness.record(command), machine="cpu2", rounds=rounds)
    record.update(what=WHAT, rows=rows)
    area = [r for r in history["zero_cost"] if r["id"] != RECORD_ID]
    history["zero_cost"] = [*area, record]
    harness.write_json(path, history)


if __name__ == "__main__":
    main()
