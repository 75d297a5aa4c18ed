"""The preemption section of BENCHMARKS.md, from `results-preemption.json`
(`bench_preemption.py`: signal to exit; `scripts/fault_matrix.py
--preemption-runs`: the fault matrix)."""

from report_format import number
from report_format import table
from report_format import when

__all__ = ("preemption",)

CASES = {
    "transformer": "the step benchmark's transformer",
    "mlp": "the step benchmark's MLP",
    "mlp_1g": "an MLP of 1 GiB of weights (4 x Dense(8192)), Adam",
}


def _signal_to_exit(run):
    lines = [
        "Time from SIGTERM (to torchrun and its workers, as a cluster sends "
        "it, after 10 steps of `fit` with `ShardedCheckpoint` under "
        "ModelParallel) to the job's exit; every rank exited with code 75 "
        "and the restarted job resumed at the next step "
        f"(measured {when(run)}, `{run['command']}`). "
        '"Saved" is when the last rank had written its shards and began '
        "to exit; the rest is the interpreters' teardown.",
        "",
    ]
    rows = [
        (
            CASES.get(r["case"], r["case"]),
            r["processes"],
            number(r["checkpoint_mib"] / 1024, 2),
            number(r["save_s"]),
            number(r.get("signal_to_saved_s")),
            number(r["signal_to_exit_s"]),
            r["steps_lost"],
        )
        for r in run["rows"]
    ]
    return lines + table(
        (
            "model",
            "processes",
            "checkpoint GiB",
            "save s",
            "signal to saved s",
            "signal to exit s",
            "steps lost",
        ),
        rows,
    )


def _matrix(run):
    lines = [
        "Fault matrix (`torchrun --standalone --nproc-per-node=2`, shuffled "
        "data, `ShardedCheckpoint` every 4 batches, keep 2; measured "
        f"{when(run)}, `{run['command']}`): survived = the job ends with "
        "the weights of an uninterrupted job bit for bit and no staging "
        "directory left (SIGTERM: every worker exited 75 and no step was "
        "trained twice; full disk: every rank raised and the checkpoint "
        "before loads). Steps lost = steps trained twice after the "
        "restart; recover s = the faulty job(s) minus an uninterrupted "
        "job, median.",
        "",
    ]
    rows = [
        (
            r["fault"],
            f"{r['survived']} of {r['runs']}",
            "-" if r["steps_lost_max"] is None else r["steps_lost_max"],
            number(r["recover_s_median"], 1),
            "-"
            if r["signal_to_exit_s_median"] is None
            else f"{number(r['signal_to_exit_s_median'])} "
            f"({number(r['signal_to_exit_s_max'])})",
            r["signals_during_a_save"]
            if r["fault"].startswith("SIGTERM")
            else "-",
        )
        for r in run["rows"]
    ]
    return lines + table(
        (
            "fault",
            "survived",
            "steps lost (max)",
            "recover s",
            "signal to exit s, median (max)",
            "signals during a save",
        ),
        rows,
    )


def preemption(data):
    run = data["results-preemption.json"]
    lines = []
    if "fault_matrix" in run:
        lines += _matrix(run["fault_matrix"]) + [""]
    if "signal_to_exit" in run:
        lines += _signal_to_exit(run["signal_to_exit"])
    return lines
