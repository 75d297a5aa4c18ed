"""Assemble `results-host.json` (issue 37's host-work figures) from the
benchmarks' own outputs, with every figure BENCHMARKS.md prints computed
here (the report only lays them out):

    python benchmarks/host_results.py \\
        --step-before before.json --step-after after.json \\
        --counts-before counts_before.json --counts-after counts_after.json \\
        --generate generate.json --commit abc1234 --before-commit def5678 \\
        --out benchmarks/results-host.json

Without `--step-before`/`--counts-before`, the "before" figures already in
`--out` are kept; without `--step-after`/`--counts-after`, its whole step
section (to record a new generate run alone); without `--generate`, its
generate section (a new step run alone); sections made elsewhere (the
checkpoints') are kept too.

`--step-no-collectives`: the step command with the no-collectives twins
(`NO_COLLECTIVES_COMMAND`), its own section (its own "before" is the
same run with collectives).

`--dp-host-cpu after.json --dp-host-cpu-before before.json`: DataParallel's
own host work as CPU time (issue 51), from `bench_step.py --models
transformer_small --variants DP_CPU_VARIANTS --rounds 5 --steps 50`, after
and before (its counts).

`--step-*`: `bench_step.py --models transformer_small --rounds 3 --steps 50
--warmup 10 --variants torch_single,keras_single,torch_ddp,kd_dp,torch_tp,
kd_mp,torch_fsdp2,kd_fsdp --out ...`; `--counts-*`: the same with
`--rounds 1 --steps 3 --warmup 5` (the counts are exact; its times are not
used); `--generate`: `bench_generate.py --rounds 3 --out ...`.
"""

import argparse
import datetime
import json
import statistics

MODEL = "transformer_small"
SHARE = 0.5  # issue 37: keras-dtensor - native <= 0.5 x (Keras - torch)
PAIRS = (
    ("DDP", "kd_dp", "torch_ddp", "kd_dp_over_ddp"),
    ("TP", "kd_mp", "torch_tp", "kd_mp_over_tp"),
    ("FSDP2", "kd_fsdp", "torch_fsdp2", "kd_fsdp_over_fsdp2"),
)
STEP_COMMAND = (
    "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 "
    "python benchmarks/bench_step.py --models transformer_small --rounds 3 "
    "--steps 50 --warmup 10 --variants torch_single,keras_single,torch_ddp,"
    "kd_dp,torch_tp,kd_mp,torch_fsdp2,kd_fsdp"
)
OFF = "_no_collectives"
NO_COLLECTIVES_COMMAND = STEP_COMMAND.replace(
    "--rounds 3", "--rounds {rounds}"
) + "".join(f",{v}{OFF}" for _, kd, native, _ in PAIRS for v in (native, kd))
GENERATE_COMMAND = "python benchmarks/bench_generate.py --rounds {rounds}"
NEW_TOKENS = 24  # bench_generate: a 32-token sequence after an 8-token prompt


def _round(x, digits=1):
    return round(x, digits)


def _pairs(run):
    table, targets = run["table"][MODEL], run["targets"][MODEL]
    keras = targets["keras_over_torch_single"]
    out = {}
    for native_name, kd, native, name in PAIRS:
        extra = targets[name]["extra_ms_per_round"]
        allowed = [SHARE * a for a in keras["extra_ms_per_round"]]
        held = sum(x <= a for x, a in zip(extra, allowed, strict=True))
        own = (table[kd]["median_ms"] - table["keras_single"]["median_ms"]) - (
            table[native]["median_ms"] - table["torch_single"]["median_ms"]
        )
        out[name] = {
            "native": native_name,
            "native_ms": _round(table[native]["median_ms"]),
            "kd_ms": _round(table[kd]["median_ms"]),
            "extra_ms": _round(statistics.median(extra)),
            "allowed_ms": _round(statistics.median(allowed)),
            "held": f"{held}/{len(extra)}",
            "own_ms": _round(own),
            "ratio": _round(targets[name]["median_of_rounds"], 2),
            "keras_ratio": _round(keras["median_of_rounds"], 2),
        }
    return out


def _no_collectives(run, meta):
    """Each pair with and without collectives, from one run: the host
    work alone against the target, the distribution's own host work, and
    what each side's collectives cost."""
    table, targets = run["table"][MODEL], run["targets"][MODEL]
    keras = targets["keras_over_torch_single"]
    allowed = [SHARE * a for a in keras["extra_ms_per_round"]]

    def rounds(variant):
        return table[variant]["round_median_ms"]

    def per_round(a, b):  # a - b within each round, its median
        return statistics.median(
            x - y for x, y in zip(rounds(a), rounds(b), strict=True)
        )

    pairs = {}
    for native_name, kd, native, name in PAIRS:
        off = targets[name + OFF]["extra_ms_per_round"]
        held = sum(x <= a for x, a in zip(off, allowed, strict=True))
        # The distribution's own, per round: (kd - Keras single) -
        # (native - torch single), without collectives.
        own = [
            (k - ks) - (n - ts)
            for k, ks, n, ts in zip(
                rounds(kd + OFF),
                rounds("keras_single"),
                rounds(native + OFF),
                rounds("torch_single"),
                strict=True,
            )
        ]
        own_held = sum(x <= a for x, a in zip(own, allowed, strict=True))
        pairs[name] = {
            "native": native_name,
            "extra_ms": _round(targets[name]["extra_ms_median_of_rounds"]),
            "extra_off_ms": _round(statistics.median(off)),
            "held_off": f"{held}/{len(off)}",
            "own_off_ms": _round(statistics.median(own)),
            "own_off_ms_per_round": [_round(x) for x in own],
            "own_held_off": f"{own_held}/{len(own)}",
            "kd_collectives_ms": _round(per_round(kd, kd + OFF)),
            "native_collectives_ms": _round(per_round(native, native + OFF)),
            "collectives": {
                v: sum(table[v]["comms_per_step"].values())
                for v in (kd, native)
            },
        }
    return {
        **meta,
        "command": NO_COLLECTIVES_COMMAND.format(rounds=run["rounds"]),
        "rounds": run["rounds"],
        "share": SHARE,
        "keras_extra_ms": _round(keras["extra_ms_median_of_rounds"]),
        "allowed_ms": _round(statistics.median(allowed)),
        "ran_none": run["no_collectives_ran_none"],
        "pairs": pairs,
    }


def _counts(run):
    return {
        variant: row["counts_per_step"]
        for variant, row in run["table"][MODEL].items()
    }


def _generate(run):
    rounds = run["round_ms"]

    def per_token(a, b):
        return statistics.median(
            (x - y) / NEW_TOKENS
            for x, y in zip(rounds[a], rounds[b], strict=True)
        )

    mine = per_token("kd_mp", "torch_tp")
    theirs = per_token("keras_single", "torch_single")
    whole = "torch_tp_whole_embedding"  # for information, where measured
    extra = {}
    if whole in rounds:
        extra = {
            "tp_whole_embedding_ms_per_token": _round(
                statistics.median(rounds[whole]) / NEW_TOKENS
            ),
            "extra_whole_embedding_ms_per_token": _round(
                per_token("kd_mp", whole)
            ),
        }
    off = "kd_mp_no_collectives", "torch_tp_no_collectives"
    if all(v in rounds for v in off):  # diagnostics, where measured

        def per_token_median(variant):
            return _round(statistics.median(rounds[variant]) / NEW_TOKENS)

        extra.update(
            kd_no_collectives_ms_per_token=per_token_median(off[0]),
            tp_no_collectives_ms_per_token=per_token_median(off[1]),
            extra_no_collectives_ms_per_token=_round(per_token(*off)),
            kd_collectives_ms_per_token=_round(per_token("kd_mp", off[0])),
            tp_collectives_ms_per_token=_round(per_token("torch_tp", off[1])),
            collectives_per_call={
                v: sum(run["collectives"][v].values())
                for v in ("kd_mp", "torch_tp")
            },
            no_collectives_ran_none=run["no_collectives_ran_none"],
        )
    return {
        **extra,
        "tp_ms_per_token": _round(
            statistics.median(rounds["torch_tp"]) / NEW_TOKENS
        ),
        "kd_ms_per_token": _round(
            statistics.median(rounds["kd_mp"]) / NEW_TOKENS
        ),
        "extra_ms_per_token": _round(mine),
        "keras_extra_ms_per_token": _round(theirs),
        "held": mine <= theirs,
        "ratio": _round(statistics.median(run["ratios"]["kd_mp_over_tp"]), 2),
        "keras_ratio": _round(
            statistics.median(run["ratios"]["keras_over_torch_single"]), 2
        ),
        "rss_mb": {k: round(v) for k, v in run["rss_mb"].items()},
        "same_tokens": run["same_tokens"],
        "rounds": len(rounds["kd_mp"]),
        "round_ms": rounds,
    }


def _step(args, read, kept, meta):
    after = read(args.step_after)
    if args.step_before:
        before = _pairs(read(args.step_before))
        counts_before = _counts(read(args.counts_before))
        before_commit = args.before_commit
    else:
        before = kept["before"]
        counts_before = kept["counts_before"]
        before_commit = kept["before_commit"]
    return {
        **meta,
        "command": STEP_COMMAND,
        "before_commit": before_commit,
        "rounds": after["rounds"],
        "share": SHARE,
        "after": _pairs(after),
        "before": before,
        "counts_after": _counts(read(args.counts_after)),
        "counts_before": counts_before,
    }


DP_CPU_VARIANTS = "torch_single_local,keras_single_local,torch_ddp,kd_dp"


def _dp_host_cpu(after, before, meta, rounds):
    """DataParallel's own host work as CPU time (issue 51), from
    `bench_step.py --variants DP_CPU_VARIANTS` output (and the same
    command's output before, for its counts)."""
    rows = []
    for variant, r in after["table"]["transformer_small"].items():
        rows.append(
            {
                "variant": variant,
                "wall_ms": round(r["median_ms"], 3),
                "cpu_ms": round(r["cpu_median_ms"], 3),
                "python_calls": r["counts_per_step"]["python_calls"],
                "package_calls": r["counts_per_step"]["package_calls"],
                "collectives": sum(r["comms_per_step"].values()),
            }
        )
    by = {r["variant"]: r for r in rows}

    def own(key):
        keras = by["keras_single_local"][key] - by["torch_single_local"][key]
        return keras, by["kd_dp"][key] - by["torch_ddp"][key] - keras

    keras_cpu, own_cpu = own("cpu_ms")
    keras_wall, own_wall = own("wall_ms")
    then = before["table"]["transformer_small"]["kd_dp"]
    return {
        **meta,
        "command": "python benchmarks/bench_step.py --models "
        f"transformer_small --variants {DP_CPU_VARIANTS} --rounds {rounds} "
        "--steps 50",
        "rounds": rounds,
        "share": 0.2,
        "before": {
            "collectives": sum(then["comms_per_step"].values()),
            "python_calls": then["counts_per_step"]["python_calls"],
            "package_calls": then["counts_per_step"]["package_calls"],
        },
        "rows": rows,
        "keras_cpu_ms": round(keras_cpu, 3),
        "own_cpu_ms": round(own_cpu, 3),
        "keras_wall_ms": round(keras_wall, 3),
        "own_wall_ms": round(own_wall, 3),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Without them, the figures already in --out are kept.
    parser.add_argument("--generate")
    for name in (
        "step-after",
        "counts-after",
        "step-before",
        "counts-before",
        "step-no-collectives",
        "dp-host-cpu",
        "dp-host-cpu-before",
    ):
        parser.add_argument(f"--{name}")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--before-commit")
    parser.add_argument(
        "--generate-commit", help="where generate was measured (--commit)"
    )
    parser.add_argument("--date", default=str(datetime.date.today()))
    parser.add_argument("--out", default="benchmarks/results-host.json")
    args = parser.parse_args(argv)

    def read(path):
        with open(path) as f:
            return json.load(f)

    # Sections not made here (the checkpoints') are kept as they are.
    try:
        result = read(args.out)
    except FileNotFoundError:
        result = {}
    meta = {"date": args.date, "commit": args.commit, "machine": "cpu2"}
    if args.step_after:
        result["step"] = _step(args, read, result.get("step", {}), meta)
    if args.step_no_collectives:
        result["step_no_collectives"] = _no_collectives(
            read(args.step_no_collectives), meta
        )
    if args.generate:
        result["generate"] = {
            **meta,
            "commit": args.generate_commit or args.commit,
            **(generate := _generate(read(args.generate))),
            "command": GENERATE_COMMAND.format(rounds=generate["rounds"]),
        }
    if args.dp_host_cpu:
        after = read(args.dp_host_cpu)
        result["dp_host_cpu"] = _dp_host_cpu(
            after, read(args.dp_host_cpu_before), meta, after["rounds"]
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
