"""The derived-layouts section of BENCHMARKS.md, from
`results-layouts.json` (`bench_layouts.py`)."""

from report_format import number
from report_format import table

__all__ = ("layouts",)

COMMAND = (
    "OMP_NUM_THREADS=1 python benchmarks/bench_layouts.py --nproc {nproc} "
    "--out benchmarks/results-layouts.json"
)


def _collectives(counts):
    if not counts:
        return "none"
    return ", ".join(f"{n:g} {kind}" for kind, n in sorted(counts.items()))


def layouts(data):
    run = data["results-layouts.json"]
    lines = [
        "`keras_dtensor.auto_layout_map` against the map keras_hub ships, "
        "for the same causal LM on a (1, "
        f"{run['nproc']}) mesh, side by side in one run (measured "
        f"{run['date']}, commit `{run['commit']}`, "
        f"`{COMMAND.format(nproc=run['nproc'])}`). Collectives are counted "
        "at dispatch for one training step and per generated token; bytes "
        "are the largest rank's parameter and AdamW shards. The goal is "
        "the collective counts and the bytes; step time on a CPU is "
        "information.",
        "",
    ]
    rows = []
    for family, maps in run["runs"].items():
        for name in ("shipped", "auto"):
            r = maps[name]
            rows.append(
                (
                    family,
                    "keras_hub's" if name == "shipped" else "auto",
                    _collectives(r["step"]),
                    _collectives(r["generate_per_token"]),
                    number((r["param_bytes"] + r["optimizer_bytes"]) / 2**20),
                    number(r["step_ms"], 1),
                )
            )
        same = maps["shipped"]["tokens"] == maps["auto"]["tokens"]
        if not same:
            rows.append((family, "tokens differ", "", "", "", ""))
    lines += table(
        (
            "family",
            "map",
            "per training step",
            "per generated token",
            "params + AdamW MiB/rank",
            "step ms",
        ),
        rows,
    )
    lines += [
        "",
        "Both maps generate the same greedy tokens for every family. "
        "keras_hub's Llama and Qwen3-MoE maps split q/k/v on the "
        "contracting (hidden) dim, so each projection's output is a "
        "partial sum, and leave the untied output head whole; the derived "
        "map splits q/k/v by heads, the head by vocabulary and "
        "Qwen3-MoE's experts by expert (their weighted sum is one more "
        "all-reduce per layer, where keras_hub's map keeps the experts "
        "whole).",
    ]
    if "plans" in run:
        lines += [
            "",
            "`auto_layout`'s own count for every family it is tested on "
            f"(the same sizes, {run['nproc']} ranks, derived in one process "
            "with nothing allocated): one all-reduce forward and one "
            "backward per attention and per MLP, one forward for a "
            "vocabulary-split embedding, and the logits gathered once.",
            "",
        ]
        rows = [
            (
                family,
                p["layers"],
                p["all_reduces_forward"],
                p["all_reduces_backward"],
                p["all_gathers_forward"],
                f"{p['split_weights']} of {p['weights']}",
                number(p["bytes_per_rank_fraction"]),
            )
            for family, p in run["plans"].items()
        ]
        lines += table(
            (
                "family",
                "layers",
                "all-reduces forward",
                "backward",
                "all-gathers",
                "weights split",
                "bytes per rank / whole",
            ),
            rows,
        )
    return lines
