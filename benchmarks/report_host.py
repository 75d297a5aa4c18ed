"""The host-work section of BENCHMARKS.md (issue 37), from
`results-host.json` (`host_results.py`: `bench_step.py` on
`transformer_small`, before and after, with one step's counts, and
`bench_generate.py`). Every figure is computed there."""

from report_format import number
from report_format import table
from report_format import when

__all__ = ("checkpoint_headline", "host_headline", "host_work")


def _rows(step):
    rows = []
    for name, now in step["after"].items():
        then = step["before"][name]
        rows.append(
            (
                f"kd-{name.split('_')[1].upper()} − {now['native']}",
                number(now["native_ms"], 1),
                number(now["kd_ms"], 1),
                number(now["extra_ms"], 1),
                number(now["allowed_ms"], 1),
                now["held"],
                number(now["own_ms"], 1),
                number(then["extra_ms"], 1),
                number(then["own_ms"], 1),
            )
        )
    return rows


def _counts(step):
    rows = []
    before, after = step["counts_before"], step["counts_after"]
    for variant, now in after.items():
        then = before.get(variant, {})
        rows.append(
            (
                variant,
                *(
                    f"{then.get(key, '-')} → {now[key]}"
                    for key in (
                        "python_calls",
                        "package_calls",
                        "dtensors",
                        "python_syncs",
                    )
                ),
            )
        )
    return rows


def host_work(data):
    run = data["results-host.json"]
    step, generate = run["step"], run["generate"]
    lines = [
        "Where a GPU will feel it: the host's work around each op. On "
        "`transformer_small` (the transformer at sizes where each op's "
        "host-side cost outweighs its arithmetic) every keras-dtensor "
        "variant runs beside its native counterpart in paired rounds "
        f"(measured {when(step)}, `{step['command']}`; before: the same "
        f"command at {step['before_commit']}, the same day). Target "
        f"(issue 37): keras-dtensor − native ≤ {step['share']} × (Keras − "
        "torch, one process) in ms, per round. keras-dtensor − native "
        "holds Keras's own overhead too; *the distribution's own* is "
        "(keras-dtensor − Keras single) − (native − torch single), medians: "
        "what the distribution adds beyond Keras's overhead and beyond the "
        "native one's.",
        "",
    ]
    lines += table(
        (
            "pair",
            "native ms",
            "keras-dtensor ms",
            "keras-dtensor − native ms",
            "target ≤ ms",
            "held (rounds)",
            "the distribution's own ms",
            "before: keras-dtensor − native ms",
            "before: the distribution's own ms",
        ),
        _rows(step),
    )
    if "step_no_collectives" in run:
        lines += _step_without_collectives(run["step_no_collectives"])
    lines += [
        "",
        "One untimed step counted (`benchmarks/step_counts.py`), before → "
        "after: Python calls, the package's own, DTensors built from "
        "Python, and calls of `.item()/.tolist()/.cpu()/.numpy()` (torch's "
        "Adam reads its CPU step counts with `.item()`, no device sync). "
        "The counts are exact on any machine. Host syncs that reach the "
        "device are counted per step by `tests/test_host_syncs.py`: every "
        "distribution has plain Keras's (one: seeded Dropout's seed).",
        "",
    ]
    lines += table(
        ("variant", "Python calls", "package calls", "DTensors", "syncs"),
        _counts(step),
    )
    lines += [
        "",
        "Generate per token (keras_hub Gemma, greedy, (1, 2) mesh; "
        f"measured {when(generate)}, `{generate['command']}`, "
        f"{generate['rounds']} rounds; tokens as in one process: "
        f"{generate['same_tokens']}). Target: kd-MP − torch TP ≤ Keras − "
        "torch, ms a token.",
        "",
    ]
    lines += table(
        (
            "torch TP ms/token",
            "kd-MP ms/token",
            "kd-MP − TP ms/token",
            "Keras − torch ms/token",
            "held",
        ),
        [
            (
                number(generate["tp_ms_per_token"], 1),
                number(generate["kd_ms_per_token"], 1),
                number(generate["extra_ms_per_token"], 1),
                number(generate["keras_extra_ms_per_token"], 1),
                "yes" if generate["held"] else "no",
            )
        ],
    )
    if "tp_whole_embedding_ms_per_token" in generate:
        lines += [
            "",
            "torch TP splits the tied embedding by vocabulary, as keras_hub's "
            "map does (an all-reduce after the lookup, the logits gathered "
            "for the sampler). The same torch TP with the embedding whole, "
            "for information: "
            f"{number(generate['tp_whole_embedding_ms_per_token'], 1)} ms a "
            "token; kd-MP − that: "
            f"{number(generate['extra_whole_embedding_ms_per_token'], 1)} ms "
            "a token.",
        ]
    if "extra_no_collectives_ms_per_token" in generate:
        lines += _without_collectives(generate)
    if "dp_host_cpu" in run:
        lines += _dp_host_cpu(run["dp_host_cpu"])
    return lines + _checkpoints(run["checkpoints"])


def _dp_host_cpu(run):
    """DataParallel's own host work as CPU time (issue 51): the main
    thread's, which the waits of a 2-process step on 2 cores leave out."""
    lines = [
        "",
        "DataParallel's own host work as the main thread's CPU time per step "
        f"(measured {when(run)}, `{run['command']}`, pooled medians), which "
        "leaves out the waits that make 2-process wall times on this "
        f"machine swing. Target (issue 51): DataParallel's own ≤ "
        f"{run['share']} × Keras's overhead. Keras − torch, one process's "
        f"share of the batch: {number(run['keras_cpu_ms'])} ms CPU; "
        "DataParallel's own, (kd-DP − DDP) − (Keras − torch): "
        f"**{number(run['own_cpu_ms'])} ms CPU** "
        f"({number(run['own_cpu_ms'] / run['keras_cpu_ms'])} ×); in wall "
        f"time {number(run['own_wall_ms'])} ms. Before (one all-reduce for "
        "the metrics beside the gradients'): "
        f"{run['before']['collectives']} collectives and "
        f"{run['before']['python_calls']} Python calls a step.",
        "",
    ]
    return lines + table(
        (
            "variant",
            "wall ms",
            "CPU ms",
            "Python calls (package's)",
            "collectives",
        ),
        [
            (
                r["variant"],
                number(r["wall_ms"]),
                number(r["cpu_ms"]),
                f"{r['python_calls']} ({r['package_calls']})",
                r["collectives"],
            )
            for r in run["rows"]
        ],
    )


def _step_without_collectives(run):
    lines = [
        "",
        "Host work alone: the same pairs, with each step's collectives "
        "made local no-ops once warm (wrong numbers, the same host work; "
        f"{'none' if run['ran_none'] else 'some'} left running; measured "
        f"{when(run)}, `{run['command']}`). Keras − torch is "
        f"{number(run['keras_extra_ms'], 1)} ms in this run, so the target "
        f"is ≤ {number(run['allowed_ms'], 1)} ms. keras-dtensor runs "
        "Keras's own step, so with its collectives gone kd − native cannot "
        "fall far below Keras − torch itself; *the distribution's own* "
        "(keras-dtensor − Keras single) − (native − torch single), taken "
        "within each round, is the host work the package adds beyond what "
        "its native counterpart adds to torch. Medians of rounds; the "
        "collectives' cost is each side minus its no-collectives twin.",
        "",
    ]
    return lines + table(
        (
            "pair",
            "keras-dtensor − native ms",
            "without collectives ms",
            "held (rounds)",
            "the distribution's own, without collectives ms (held)",
            "collectives cost keras-dtensor / native ms",
            "collectives a step keras-dtensor / native",
        ),
        [
            (
                f"kd-{name.split('_')[1].upper()} − {p['native']}",
                number(p["extra_ms"], 1),
                number(p["extra_off_ms"], 1),
                p["held_off"],
                f"{number(p['own_off_ms'], 1)} ({p['own_held_off']})",
                f"{number(p['kd_collectives_ms'], 1)} / "
                f"{number(p['native_collectives_ms'], 1)}",
                " / ".join(str(n) for n in p["collectives"].values()),
            )
            for name, p in run["pairs"].items()
        ],
    )


def _without_collectives(generate):
    calls = generate["collectives_per_call"]
    return [
        "",
        "Where the difference goes: the same two split runs with every "
        "collective made a local no-op once warm (wrong tokens, the same "
        "host work; "
        f"{'none' if generate['no_collectives_ran_none'] else 'some'} left "
        "running). Without collectives, kd-MP − torch TP is "
        f"{number(generate['extra_no_collectives_ms_per_token'], 1)} ms a "
        f"token (kd-MP {number(generate['kd_no_collectives_ms_per_token'], 1)}"
        f", torch TP {number(generate['tp_no_collectives_ms_per_token'], 1)})"
        f", against Keras − torch's "
        f"{number(generate['keras_extra_ms_per_token'], 1)}. The collectives "
        f"cost kd-MP {number(generate['kd_collectives_ms_per_token'], 1)} ms "
        f"a token ({calls['kd_mp']} a call) and torch TP "
        f"{number(generate['tp_collectives_ms_per_token'], 1)} "
        f"({calls['torch_tp']} a call).",
    ]


def _checkpoints(run):
    lines = [
        "",
        f"Checkpoints against DCP ({run['what']}; measured {when(run)}, "
        f"`{run['command']}`; before: {run['before_commit']}). Integrity is "
        "still checked: a CRC-32 per 16 MiB block, taken while the bytes "
        "are written and while a load checks them.",
        "",
    ]
    return lines + table(
        ("case", "÷ DCP before", "÷ DCP after", "target ≤", "rounds"),
        [
            (
                f"`{r['case']}`",
                number(r["before"]),
                number(r["after"]),
                number(r["target"], 1),
                r["rounds"],
            )
            for r in run["rows"]
        ],
    )


def checkpoint_headline(data):
    """Headline rows: checkpoints against DCP."""
    run = data["results-host.json"]["checkpoints"]
    return [
        (
            "DCP",
            f"`{r['case']}`",
            r["model"],
            number(r["after"]),
            "-",
            f"≤ {number(r['target'], 1)}: "
            f"{'held' if r['after'] <= r['target'] else 'not held'} "
            f"(before {number(r['before'])})",
            "-",
            when(run),
        )
        for r in run["rows"]
    ]


def host_headline(data):
    """Headline rows: the step pairs on `transformer_small`."""
    run = data["results-host.json"]
    step = run["step"]
    off = run.get("step_no_collectives", {}).get("pairs", {})

    def alone(name):
        pair = off.get(name)
        if pair is None:
            return ""
        commit = run["step_no_collectives"]["commit"]
        return (
            f"; at {commit} without collectives {pair['extra_off_ms']:+.1f}, "
            f"{pair['held_off']}, the distribution's own "
            f"{pair['own_off_ms']:+.1f} ms, {pair['own_held_off']}"
        )

    return [
        (
            now["native"],
            "host work a step",
            "transformer_small",
            number(now["ratio"]),
            number(now["keras_ratio"]),
            f"{now['held']} at ≤ {step['share']} × (Keras − torch) ms "
            f"({now['extra_ms']:+.1f} against "
            f"{number(now['allowed_ms'], 1)} ms{alone(name)})",
            "-",
            when(step),
        )
        for name, now in step["after"].items()
    ]
