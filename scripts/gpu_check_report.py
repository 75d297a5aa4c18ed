"""One table of keras-dtensor against native torch, from gpu_check.sh's runs.

    python scripts/gpu_check_report.py DIR --models mlp,transformer

Reads DIR/step.json and DIR/step_tp.json (`bench_step.py --out`),
DIR/generate.json (`bench_generate.py --out`) and DIR/checkpoint.json
(`bench_checkpoint.py --out`), writes DIR/summary.md and prints it. Every
row is keras-dtensor's time over its torch counterpart's (the ratio: the
median over rounds of each round's ratio where the benchmark pairs them
by round) and the milliseconds it adds. Exits 1 naming the rows a stage
left without numbers.

`--smoke ROWS` (gpu_check.sh --smoke): the rows left out on purpose, each
a stage (`generate`) or a stage and its keras-dtensor variant
(`step:kd_mp`); they read "not run (smoke)" instead of failing the report.
Every other row must have its numbers.
"""

import argparse
import json
import os
import statistics
import sys

# (bench_step target, numerator, denominator)
STEP = (
    ("kd_dp_over_ddp", "kd_dp", "torch_ddp"),
    ("kd_mp_over_tp", "kd_mp", "torch_tp"),
    ("kd_fsdp_over_fsdp2", "kd_fsdp", "torch_fsdp2"),
    ("keras_over_torch_single", "keras_single", "torch_single"),
)
STEP_FILES = ("step.json", "step_tp.json")
GENERATE = (
    ("kd_mp", "torch_tp"),
    ("keras_single", "torch_single"),
    # Both split variants with their collectives made no-ops: host work.
    ("kd_mp_no_collectives", "torch_tp_no_collectives"),
)


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _step_rows(directory, models):
    runs = [_load(os.path.join(directory, f)) for f in STEP_FILES]
    runs = [run for run in runs if run is not None]
    for model in models:
        for target, a, b in STEP:
            found = None
            for run in runs:
                value = run["targets"].get(model, {}).get(target)
                if value:
                    found = (run["table"][model], value)
            if found is None:
                yield ("step", model, a, b, None)
                continue
            table, value = found
            yield (
                "step",
                model,
                a,
                b,
                dict(
                    procs=table[a]["processes"],
                    a_ms=table[a]["median_ms"],
                    b_ms=table[b]["median_ms"],
                    ratio=value["median_of_rounds"],
                    extra=value["extra_ms_median_of_rounds"],
                ),
            )


def _generate_rows(directory):
    run = _load(os.path.join(directory, "generate.json"))
    for a, b in GENERATE:
        if run is None:
            yield ("generate", "gemma", a, b, None)
            continue
        pairs = list(zip(run["round_ms"][a], run["round_ms"][b], strict=True))
        yield (
            "generate",
            "gemma",
            a,
            b,
            dict(
                procs=1 if a == "keras_single" else run["nproc"],
                a_ms=statistics.median(x for x, _ in pairs),
                b_ms=statistics.median(y for _, y in pairs),
                ratio=statistics.median(x / y for x, y in pairs),
                extra=statistics.median(x - y for x, y in pairs),
            ),
        )


def _checkpoint_rows(directory):
    run = _load(os.path.join(directory, "checkpoint.json"))
    for phase in ("save", "load"):
        if run is None:
            yield ("checkpoint", phase, "kd", "dcp", None)
            continue
        kd = 1000 * run["table"]["kd"][f"{phase}_s"]
        dcp = 1000 * run["table"]["dcp"][f"{phase}_s"]
        yield (
            "checkpoint",
            phase,
            "kd",
            "dcp",
            dict(
                procs=run["nproc"],
                a_ms=kd,
                b_ms=dcp,
                ratio=kd / dcp,
                extra=kd - dcp,
            ),
        )


def _not_run(key, stage, a):
    return key in (stage, f"{stage}:{a}")


def report(directory, models, header="", not_run=()):
    """Returns (the Markdown summary, the rows left without numbers).

    `not_run`: "stage" or "stage:variant" keys of rows left out on
    purpose, marked "not run (smoke)" when they have no numbers; a key
    that names no row raises ValueError (a typo would hide nothing)."""
    lines = [
        "| stage | model | keras-dtensor | torch | procs | "
        "keras-dtensor ms | torch ms | ratio | extra ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    missing = []
    rows = [
        *_step_rows(directory, models),
        *_generate_rows(directory),
        *_checkpoint_rows(directory),
    ]
    unknown = [
        key
        for key in not_run
        if not any(_not_run(key, row[0], row[2]) for row in rows)
    ]
    if unknown:
        raise ValueError(f"--smoke names no row: {', '.join(unknown)}")
    for stage, model, a, b, value in rows:
        if value is None and any(_not_run(k, stage, a) for k in not_run):
            lines.append(
                f"| {stage} | {model} | {a} | {b} | not run (smoke) |||||"
            )
            continue
        if value is None:
            missing.append(f"{stage} {model} {a}/{b}")
            lines.append(f"| {stage} | {model} | {a} | {b} | missing |||||")
            continue
        lines.append(
            f"| {stage} | {model} | {a} | {b} | {value['procs']} | "
            f"{value['a_ms']:.2f} | {value['b_ms']:.2f} | "
            f"{value['ratio']:.2f} | {value['extra']:+.2f} |"
        )
    text = "\n".join(([header, ""] if header else []) + lines) + "\n"
    return text, missing


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--models", default="mlp,transformer,transformer_small")
    parser.add_argument("--header", default="", help="a line above the table")
    parser.add_argument(
        "--smoke",
        default="",
        metavar="ROWS",
        help="rows not run on purpose: stage or stage:variant, commas",
    )
    args = parser.parse_args(argv)
    not_run = [key for key in args.smoke.split(",") if key]
    try:
        text, missing = report(
            args.directory, args.models.split(","), args.header, not_run
        )
    except ValueError as error:
        parser.error(str(error))
    with open(os.path.join(args.directory, "summary.md"), "w") as f:
        f.write(text)
    print(text, end="")
    if missing:
        print(f"rows without numbers: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
