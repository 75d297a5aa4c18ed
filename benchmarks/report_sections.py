"""The memory, checkpoints, generate, faults, zero cost and input
sections."""

from report_format import by_id
from report_format import number
from report_format import numbers
from report_format import table
from report_format import when

__all__ = (
    "memory",
    "checkpoints",
    "generate",
    "faults",
    "zero_cost",
    "input_work",
)

NO_DIST_METHODS = ("fit", "train_on_batch", "predict")


def memory(data):
    runs = by_id(data, "memory")
    mp = runs["mp-memory"]
    lines = [f"ModelParallel against torch TP, {mp['what']}:", ""]
    rows = []
    for row in mp["rows"]:
        cells = [f"({row['model']})"]
        if row.get("superseded_by"):
            cells[0] += f", superseded by `{row['superseded_by']}` below"
        for key in ("fit_peak", "steady", "load_peak"):
            value = row.get(key)
            cells.append(
                f"{value['kd']} / {value['torch_tp']} "
                f"({number(value['ratio'])})"
                if value
                else "-"
            )
        rows.append(cells)
    lines += table(
        ("model", "fit peak, kd / TP", "steady after fit", "load peak"),
        rows,
    )
    trim = runs["mp-memory-c-trim"]
    peaks = numbers([r["fit_peak"]["ratio"] for r in trim["runs"]], 2, ", ")
    steady = numbers([r["steady"]["ratio"] for r in trim["runs"]], 2, ", ")
    lines += [
        "",
        f"Model (c) since `fit` gives back glibc's free memory first "
        f"(`{trim['command']}`, {when(trim)}; {trim['what']}): fit peak "
        f"kd ÷ TP {peaks}, steady {steady}.",
        "",
    ]
    ref = runs["mp-memory-c-reference"]
    lines += [f"Model (c) in live memory ({ref['what']}; {when(ref)}):", ""]
    lines += table(
        ("figure", "TP", "kd", "kd ÷ TP", "torch", "Keras", "Keras ÷ torch"),
        [
            (
                r["figure"],
                r["torch_tp"],
                r["kd"],
                number(r["kd_over_tp"]),
                r["torch_single"],
                r["keras_single"],
                number(r["keras_over_torch"]),
            )
            for r in ref["rows"]
        ],
    )
    plan = runs["plan-vs-measured"]
    lines += ["", f"`plan` against the measurement ({plan['what']}):", ""]
    lines += table(
        (
            "model",
            "plan",
            "state",
            "steady",
            "steady, malloc_trim",
            "steady ÷ plan",
            "trimmed ÷ plan",
        ),
        [
            (
                f"({r['model']})",
                r["plan"],
                r["state"],
                r["steady"],
                r["steady_trimmed"],
                number(r["steady_over_plan"]),
                number(r["trimmed_over_plan"]),
            )
            for r in plan["rows"]
        ],
    )
    for run_id, head, keys in (
        ("fsdp-memory", ("fit peak", "steady"), ("fit_peak", "steady")),
        (
            "sharded-init",
            ("before the model", "init peak", "steady", "peak ÷ steady"),
            ("before_model", "init_peak", "steady", "model_peak_over_steady"),
        ),
    ):
        run = runs[run_id]
        lines += ["", f"{_capital(run['what'])} ({when(run)}):", ""]
        rows = [
            (r["case"], *(_cell(r.get(k)) for k in keys)) for r in run["rows"]
        ]
        lines += table(("", *head), rows)
    return lines


def _capital(text):
    return text[:1].upper() + text[1:]


def _cell(value):
    if isinstance(value, float):
        return number(value)
    return "-" if value is None else value


def checkpoints(data):
    runs = by_id(data, "checkpoints")
    sharded = runs["sharded-vs-dcp"]
    lines = [f"`ShardedCheckpoint` against DCP: {sharded['what']}.", ""]
    rows = [
        (
            r["variant"],
            number(r["save_s"]),
            number(r["load_s"]),
            r["save_mib_per_rank"],
            r["load_mib_per_rank"],
        )
        for r in sharded["rows"]
    ]
    rows.append(
        (
            "ratio",
            number(sharded["save_ratio"]),
            number(sharded["load_ratio"]),
            "",
            "",
        )
    )
    lines += table(
        ("", "save s", "load s", "save +MiB/rank", "load +MiB/rank"), rows
    )
    other = sharded["other_runs"]
    lines += [
        "",
        f"Other runs of the same command: save "
        f"{numbers(other['save_ratio'], 2, ', ')}, load "
        f"{numbers(other['load_ratio'], 2, ', ')}.",
        "",
    ]
    save = runs["model-save-in-place"]
    lines += [f"Keras's own formats against DCP: {save['what']}.", ""]
    lines += table(
        ("case", "seconds", "÷ DCP", "extra memory ÷ model, ranks in order"),
        [
            (
                f"`{r['case']}`" if "DCP" not in r["case"] else r["case"],
                numbers(r["seconds"], 2, ", "),
                numbers(r.get("over_dcp", []), 1, ", ") or "-",
                numbers(r["extra_memory_over_model"], 2, ", "),
            )
            for r in save["rows"]
        ],
    )
    return lines


def generate(data):
    run = by_id(data, "generate")["generate-vs-tp"]
    lines = [f"{run['what']}.", ""]
    lines += table(
        ("variant", "per round, ms", "median", "peak RSS MB"),
        [
            (
                name,
                numbers(v["per_round_ms"], 1, ", "),
                number(v["median_ms"], 1),
                v["peak_rss_mb"],
            )
            for name, v in run["variants"].items()
        ],
    )
    lines += [""]
    lines += table(
        ("ratio", "per round", "median", "extra ms a token"),
        [
            (
                name,
                numbers(v["per_round"], 2, ", "),
                number(v["median_of_rounds"]),
                v["extra_ms_per_token"],
            )
            for name, v in run["targets"].items()
        ],
    )
    return lines


def faults(data):
    runs = by_id(data, "faults")
    lines = [f"Fault matrix: {runs['fault-matrix']['what']}.", ""]
    rows = []
    for run_id in ("fault-matrix", "fault-matrix-sharded"):
        for r in runs[run_id]["rows"]:
            rows.append(
                (
                    r["fault"],
                    f"{r['survived']} of {r['runs']}",
                    number(r.get("job_s_median"), 1),
                    when(runs[run_id]),
                )
            )
    lines += table(("fault", "survived", "job s (median)", "measured"), rows)
    abort = runs["abort-at-exit"]
    before, after = abort["before"], abort["after"]
    lines += [
        "",
        f"Abort at exit ({abort['what']}): {before['aborted']} of "
        f"{before['runs']} runs before, {after['aborted']} of "
        f"{after['runs']} after.",
        "",
        f"Cost of the input checks ({runs['input-check-cost']['command']}):",
        "",
    ]
    lines += table(
        ("check", "ms"),
        [
            (r["check"], "-".join(number(v, 3) for v in r["ms"]))
            for r in runs["input-check-cost"]["rows"]
        ],
    )
    return lines


def zero_cost(data):
    runs = by_id(data, "zero_cost")
    no_dist, hooks = runs["no-dist"], runs["hooks-alone"]
    lines = [f"{_capital(no_dist['what'])}:", ""]
    rows = []
    for r in no_dist["rows"]:
        cells = [
            f"{number(r[m][0])} ({number(r[m][1])}-{number(r[m][2])})"
            for m in NO_DIST_METHODS
        ]
        rows.append((r["model"], r["variant"], *cells))
    lines += table(("model", "variant", *NO_DIST_METHODS), rows)
    lines += ["", f"The hooks alone ({hooks['what']}):", ""]
    lines += table(
        ("model", "method", "hooks on ms", "uninstalled ms", "on ÷ off"),
        [
            (
                r["model"],
                r["method"],
                number(r["on_ms"], 3),
                number(r["off_ms"], 3),
                number(r["ratio"], 3),
            )
            for r in hooks["rows"]
        ],
    )
    jit = runs.get("jit-no-dist")
    if jit is not None:
        lines += ["", f"{_capital(jit['what'])} ({when(jit)}):", ""]
        lines += table(
            (
                "Inductor cache",
                "plain Keras s",
                "with keras_dtensor s",
                "ratio",
            ),
            [
                (
                    r["cache"],
                    number(r["plain_s"], 1),
                    number(r["kd_s"], 1),
                    f"{number(r['ratio'][0], 3)} ({number(r['ratio'][1], 3)}"
                    f"-{number(r['ratio'][2], 3)})",
                )
                for r in jit["rows"]
            ],
        )
    return lines


_INPUT_VARIANTS = {
    "ddp_sampler": "torch DDP, `DistributedSampler`",
    "kd_sharded": "keras-dtensor DataParallel, `DataLoader`",
    "kd_whole": "the same, `KERAS_DTENSOR_SHARDED_LOADING=0`",
    "kd_pydataset": "keras-dtensor DataParallel, `PyDataset`",
}


def input_work(data):
    run = data["results-input.json"]
    lines = [
        "Input work per rank on an input-bound map-style dataset "
        f"({run['samples']} samples, each costing {run['sample_ms']} ms of "
        f"CPU to load; one shuffled epoch at a global batch of "
        f"{run['batch']}; measured {when(run)}, `{run['command']}`). "
        "Samples read per rank include Keras's first-batch build; the goal "
        "(issue 49) is the global count ÷ N plus at most one batch, and an "
        "epoch within 1.1 × DDP's. The machine has 2 cores: at 4 processes "
        "two share each core.",
        "",
    ]
    lines += table(
        (
            "processes",
            "input",
            "epoch s",
            "÷ DDP (median of rounds)",
            "samples read per rank",
            "goal ≤",
        ),
        [
            (
                r["processes"],
                _INPUT_VARIANTS[r["variant"]],
                number(r["epoch_s"]),
                number(r["over_ddp"]),
                r["reads_per_rank"],
                r["goal_reads"],
            )
            for r in run["rows"]
        ],
    )
    return lines
