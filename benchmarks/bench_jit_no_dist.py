"""`jit_compile=True` with nothing distributed: plain Keras against the same
program with `import keras_dtensor` first, compile time included.

    python benchmarks/bench_jit_no_dist.py --rounds 2 [--save]

Each run is a fresh process with one thread: a `Sequential` MLP (3 x
Dense(64), Adam), `compile(jit_compile=True)`, `fit` for 2 epochs on 256
rows at batch 32 with `validation_split=0.25`, then `evaluate` and
`predict`. The seconds from `compile` to the end of `predict` are timed,
so torch.compile's tracing and Inductor's code generation are in them.
Each variant has its own Inductor cache directory per round: the first
run of it is cold (an empty cache), the second warm (the cache the first
filled). Variants alternate order every round; each round's ratio is
taken within the round. `--save` writes the record into
`results-history.json` (area `zero_cost`, id `jit-no-dist`), which
`report.py` turns into BENCHMARKS.md. Target (issue 51): within 5% of
plain Keras, cold and warm.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step import head_commit  # noqa: E402

VARIANTS = ("plain", "kd")
RECORD_ID = "jit-no-dist"
_MARK = "RESULT "


def worker(variant):
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
    print(_MARK + json.dumps({"wall": wall, "cpu": cpu}), flush=True)


def _launch(variant, cache):
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=cache,
    )
    out = subprocess.run(
        [sys.executable, __file__, "--worker", variant],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = [x for x in out.splitlines() if x.startswith(_MARK)][-1]
    return json.loads(line[len(_MARK) :])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    seconds = {(v, c): [] for v in VARIANTS for c in ("cold", "warm")}
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            with tempfile.TemporaryDirectory() as cache:
                for cache_state in ("cold", "warm"):
                    took = _launch(variant, cache)["wall"]
                    seconds[variant, cache_state].append(took)
                    print(
                        f"round {round_} {variant} {cache_state}: {took:.1f} s"
                    )
    rows = []
    for cache_state in ("cold", "warm"):
        plain = seconds["plain", cache_state]
        kd = seconds["kd", cache_state]
        ratios = [k / p for k, p in zip(kd, plain, strict=True)]
        rows.append(
            {
                "cache": cache_state,
                "plain_s": statistics.median(plain),
                "kd_s": statistics.median(kd),
                "ratio": [
                    statistics.median(ratios),
                    min(ratios),
                    max(ratios),
                ],
            }
        )
        print(
            f"{cache_state}: plain {statistics.median(plain):.1f} s, "
            f"kd {statistics.median(kd):.1f} s, kd / plain "
            f"{statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    if args.save:
        _save(rows, args.rounds)


def _save(rows, rounds):
    """Puts the record last in `results-history.json`'s `zero_cost` list
    (its last area), replacing an earlier one; the rest of the file is
    left as it is written."""
    path = os.path.join(HERE, "results-history.json")
    with open(path) as f:
        text = f.read()
    commit = head_commit()
    record = {
        "id": RECORD_ID,
        "source": "benchmarks/bench_jit_no_dist.py",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": "cpu2",
        "command": f"python benchmarks/bench_jit_no_dist.py --rounds {rounds}",
        "rounds": rounds,
        "what": (
            "compile time with jit_compile=True, nothing distributed: fit 2 "
            "epochs (256 rows, validation_split 0.25), evaluate and predict "
            "of a 3 x Dense(64) MLP, fresh processes, an Inductor cache per "
            "variant and round (cold: empty, warm: filled by the cold run); "
            "median seconds and per-round kd / plain ratios (min-max)"
        ),
        "rows": rows,
    }
    marker = '\n  {\n   "id": "' + RECORD_ID + '"'
    if marker in text:
        text = text[: text.index(marker)].rstrip(",") + "\n ]\n}\n"
    head = text.rstrip()
    if not head.endswith("]\n}"):
        raise ValueError("zero_cost is no longer the last area")
    head = head[: -len("]\n}")].rstrip()
    lines = ",\n".join(
        f"   {json.dumps(k)}: "
        + (
            "[\n" + ",\n".join(f"    {json.dumps(r)}" for r in v) + "\n   ]"
            if k == "rows"
            else json.dumps(v)
        )
        for k, v in record.items()
    )
    with open(path, "w") as f:
        f.write(head + ",\n  {\n" + lines + "\n  }\n ]\n}\n")


if __name__ == "__main__":
    main()
