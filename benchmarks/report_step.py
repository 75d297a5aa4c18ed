"""The step time section.

Paired ratios from the newest run of each, the medians behind them,
Keras's own overhead, the costs of single changes and every variant
unpaired.
"""

from report_format import COMPARISONS
from report_format import MODELS
from report_format import REFERENCE
from report_format import by_id
from report_format import held
from report_format import latest
from report_format import number
from report_format import numbers
from report_format import step_runs
from report_format import table
from report_format import when

__all__ = ("step",)


def step(data):
    found = latest(data)
    rows = []
    for model in MODELS:
        for name, label, _ in COMPARISONS:
            if (model, name) not in found:
                continue
            record, run = found[model, name]
            reference = run["targets"][model].get(REFERENCE, {})
            extra = record.get("extra_ms_median_of_rounds")
            ref_extra = reference.get("extra_ms_median_of_rounds")
            rows.append(
                (
                    model,
                    label,
                    f"{number(record['median_of_rounds'])} "
                    f"({numbers(record['per_round'])})",
                    number(reference.get("median_of_rounds")),
                    "-"
                    if extra is None
                    else f"{number(extra, 1)} / {number(ref_extra, 1)}",
                    held(record),
                    run["rounds"],
                    when(run),
                )
            )
    lines = [
        "Paired rounds; for each ratio the newest run that measured it. "
        "`transformer_small` is the transformer at sizes where each op's "
        "host-side cost outweighs its arithmetic (a CPU's view of a GPU "
        "step). Runs on one GPU (one process, no communication) are in "
        "the history only.",
        "",
    ]
    lines += table(
        (
            "model",
            "ratio",
            "median of rounds (per round)",
            "Keras ÷ torch, same run",
            "extra ms: keras-dtensor − native / Keras − torch",
            "held",
            "rounds",
            "measured",
        ),
        rows,
    )
    lines += ["", "Medians of the same runs, ms:", ""]
    rows = []
    for run in step_runs(data):
        for model, medians in run.get("median_ms", {}).items():
            text = ", ".join(f"{k} {number(v, 1)}" for k, v in medians.items())
            rows.append((model, text, when(run)))
    lines += table(("model", "median ms per variant", "measured"), rows)
    lines += ["", *_references(data), "", *_costs(data)]
    lines += ["", *_full_table(data)]
    return lines


def _costs(data):
    fsdp = by_id(data, "step")["fsdp-packs-unzeroed"]
    counts = "; ".join(
        f"{model} {c['kd_fsdp']} against FSDP2's {c['torch_fsdp2']}"
        for model, c in fsdp["collectives_per_step"].items()
    )
    lines = [
        f"FSDP-style collectives per step ({when(fsdp)}): {counts}; "
        "param+opt bytes per rank "
        f"{number(fsdp['param_opt_bytes_over_full_div_n'])} x full ÷ N.",
        "",
    ]
    for run in data["results-history.json"]["step_costs"]:
        lines += [f"{run['what']} ({when(run)}):", ""]
        rows = [
            (
                r["case"],
                number(r["before_ms"]),
                number(r["after_ms"]),
                number(r["added_ms"]),
            )
            for r in run["rows"]
        ]
        lines += table(
            ("", "own rows drawn, ms", "global mask drawn, ms", "added ms"),
            rows,
        )
    return lines


def _references(data):
    """Keras's own overhead at one rank's share of the batch."""
    meta = data["results-history.json"]["files"]["results-targets.json"]
    targets = data["results-targets.json"]["targets"]
    rows = []
    for model, ratios in targets.items():
        for name in (
            REFERENCE,
            "keras_over_torch_local",
            "keras_over_torch_pair",
        ):
            record = ratios[name]
            rows.append(
                (
                    model,
                    name,
                    number(record["median_of_rounds"]),
                    number(record["extra_ms_median_of_rounds"], 1),
                )
            )
    head = ("model", "reference", "median of rounds", "extra ms")
    return [
        "Keras's own overhead at one rank's share of the batch, alone "
        "(`_local`) and two side by side (`_pair`), "
        f"`results-targets.json` ({when(meta)}):",
        "",
        *table(head, rows),
    ]


def _full_table(data):
    meta = data["results-history.json"]["files"]["results.json"]
    summary = data["results.json"]
    rows = []
    for model, variants in summary["table"].items():
        for variant, row in variants.items():
            comms = ", ".join(
                f"{k.split('.')[-1]} {v}"
                for k, v in row["comms_per_step"].items()
            )
            rows.append(
                (
                    model,
                    variant,
                    row["processes"],
                    number(row["median_ms"], 1),
                    number(row["rss_mb"], 0),
                    number(row["bytes_per_rank"] / 2**20, 1),
                    comms or "-",
                )
            )
    head = (
        "model",
        "variant",
        "procs",
        "median ms",
        "peak RSS MB",
        "param+opt MiB/rank",
        "collectives/step",
    )
    return [
        f"Every variant, unpaired, `results.json` ({when(meta)}; "
        f"{meta['note']}):",
        "",
        *table(head, rows),
    ]
