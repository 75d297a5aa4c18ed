"""The headline table: keras-dtensor against each native counterpart.

Step time from the newest run of each ratio, then memory, generate and
sharded checkpoints.
"""

import statistics

from report_format import COMPARISONS
from report_format import MODELS
from report_format import REFERENCE
from report_format import by_id
from report_format import held
from report_format import latest
from report_format import number
from report_format import table
from report_format import when
from report_host import checkpoint_headline
from report_host import host_headline

__all__ = ("headline",)


def _peak(run, model, variant):
    return run.get("peak_rss_mb", {}).get(model, {}).get(variant)


def headline(data):
    found = latest(data)
    head = (
        "against",
        "what",
        "model",
        "keras-dtensor ÷ native",
        "Keras ÷ torch, one process, same run",
        "held",
        "memory per rank, MiB (keras-dtensor / native)",
        "measured",
    )
    rows = []
    variants = {"DDP": "dp", "TP": "mp", "FSDP2": "fsdp"}
    natives = {"DDP": "torch_ddp", "TP": "torch_tp", "FSDP2": "torch_fsdp2"}
    for name, _, native in COMPARISONS[:3]:
        for model in MODELS[:2]:
            record, run = found[model, name]
            reference = run["targets"][model][REFERENCE]
            kd = _peak(run, model, f"kd_{variants[native]}")
            theirs = _peak(run, model, natives[native])
            memory = "-"
            if kd is not None:
                memory = f"peak {number(kd, 0)} / {number(theirs, 0)}"
            rows.append(
                (
                    native,
                    "step time",
                    model,
                    number(record["median_of_rounds"]),
                    number(reference["median_of_rounds"]),
                    held(record),
                    memory,
                    when(run),
                )
            )
    rows += host_headline(data)
    rows += _memory_headline(data)
    rows += _generate_headline(data)
    rows += checkpoint_headline(data)
    return table(head, rows)


def _memory_headline(data):
    runs = by_id(data, "memory")
    mp, trim = runs["mp-memory"], runs["mp-memory-c-trim"]
    rows = []
    for row in mp["rows"]:
        if row.get("superseded_by"):
            continue
        peak, steady = row["fit_peak"], row["steady"]
        rows.append(
            (
                "TP",
                "memory",
                f"({row['model']})",
                f"{number(peak['ratio'])} peak, "
                f"{number(steady['ratio'])} steady",
                "-",
                "-",
                f"peak {peak['kd']} / {peak['torch_tp']}, "
                f"steady {steady['kd']} / {steady['torch_tp']}",
                when(mp),
            )
        )
    peaks = [r["fit_peak"] for r in trim["runs"]]
    ratio = statistics.median(p["ratio"] for p in peaks)
    steady = statistics.median(r["steady"]["ratio"] for r in trim["runs"])
    low, high = trim["torch_tp_fit_peak_range"]
    kd = statistics.median(p["kd"] for p in peaks)
    rows.append(
        (
            "TP",
            "memory",
            "(c)",
            f"{number(ratio)} peak, {number(steady)} steady "
            f"(median of {len(peaks)} runs)",
            "-",
            "-",
            f"peak {kd} / {low}-{high}",
            when(trim),
        )
    )
    fsdp = runs["fsdp-memory"]
    torch_row, default, per_layer = fsdp["rows"][:3]
    rows.append(
        (
            "FSDP2",
            "memory",
            "(d)",
            f"{number(default['fit_peak_over_fsdp2'])} peak "
            f"({number(per_layer['fit_peak_over_fsdp2'])} a group per layer)",
            "-",
            "-",
            f"peak {default['fit_peak']} / {torch_row['fit_peak']}, "
            f"steady {default['steady']} / {torch_row['steady']}",
            when(fsdp),
        )
    )
    return rows


def _generate_headline(data):
    run = data["results-host.json"]["generate"]
    rss = run["rss_mb"]
    return [
        (
            "TP",
            "generate",
            "keras_hub Gemma",
            number(run["ratio"]),
            number(run["keras_ratio"]),
            f"in ms {'held' if run['held'] else 'not held'} "
            f"(+{number(run['extra_ms_per_token'], 1)} against "
            f"+{number(run['keras_extra_ms_per_token'], 1)} ms a token)",
            f"peak {rss['kd_mp']} / {rss['torch_tp']}",
            when(run),
        )
    ]
