"""`scripts/gpu_check.sh`, the one command for a multi-GPU machine.

It cannot run here on CUDA; its CPU fallback (`--device cpu`) runs the
same stages over gloo, so a renamed flag, a changed JSON or a broken stage
shows up before someone spends GPU time on it. `--smoke` (3 torchrun
launches: bench_step's torch_ddp and kd_dp, bench_checkpoint; about half a
minute on 2 cores) runs in the suite; every row under `--quick` is 13
launches (minutes): `slow`. The other tests check the flags the script
passes and that a missing row fails the report.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
# The flags gpu_check.sh passes to each benchmark.
FLAGS = {
    "bench_step.py": "--device --nproc --rounds --models --variants "
    "--steps --warmup --out",
    "bench_generate.py": "--device --nproc --rounds --calls --out",
    "bench_checkpoint.py": "--device --nproc --rounds --vocab --out",
}


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


@pytest.mark.parametrize("script", sorted(FLAGS))
def test_benchmarks_take_the_flags_it_passes(script):
    path = os.path.join(ROOT, "benchmarks", script)
    usage = subprocess.run(
        [sys.executable, path, "--help"], capture_output=True, text=True
    )
    assert usage.returncode == 0, usage.stderr
    for flag in FLAGS[script].split():
        assert flag in usage.stdout, f"{script} has no {flag}"
    with open(SCRIPT) as f:
        assert script in f.read()


def test_a_missing_stage_fails_the_report(tmp_path):
    report = os.path.join(ROOT, "scripts", "gpu_check_report.py")
    result = subprocess.run(
        [sys.executable, report, str(tmp_path), "--models", "mlp"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "generate gemma kd_mp/torch_tp" in result.stderr
    assert "missing" in (tmp_path / "summary.md").read_text()


def test_smoke_marks_its_rows_and_fails_the_rest(tmp_path):
    # What gpu_check.sh --smoke passes, over a run that left no JSON: the
    # rows smoke leaves out say so; the ones it runs still fail.
    report = os.path.join(ROOT, "scripts", "gpu_check_report.py")
    not_run = "step:keras_single,step:kd_mp,step:kd_fsdp,generate"
    result = subprocess.run(
        [sys.executable, report, str(tmp_path), "--models", "mlp"]
        + ["--smoke", not_run],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    missing = result.stderr.split("rows without numbers: ")[1].split(", ")
    assert sorted(m.strip() for m in missing) == [
        "checkpoint load kd/dcp",
        "checkpoint save kd/dcp",
        "step mlp kd_dp/torch_ddp",
    ]
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("not run (smoke)") == 6
    typo = subprocess.run(
        [sys.executable, report, str(tmp_path), "--smoke", "step:kd_tp"],
        capture_output=True,
        text=True,
    )
    assert typo.returncode == 2
    assert "names no row: step:kd_tp" in typo.stderr


def _summary_rows(out):
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in (out / "summary.md").read_text().splitlines()
        if re.match(r"\| (step|generate|checkpoint) ", line)
    ]


def _assert_numbers(row):
    procs, *numbers = row[4:]
    assert procs == "2" or row[2] == "keras_single", row
    for number in numbers:
        float(number)  # "missing" (or an empty cell) raises
    assert len(numbers) == 4, row


def test_cuda_without_gpus_is_refused(tmp_path):
    result = subprocess.run(
        ["bash", SCRIPT, "--device", "cuda", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**_env(), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2
    assert "no GPU visible" in result.stderr


@pytest.mark.multiprocess
def test_cpu_smoke_runs_each_stage_end_to_end(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", SCRIPT, "--device", "cpu", "--nproc", "2", "--smoke"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for stage in ("step", "checkpoint", "report"):
        assert f"== {stage} ok (" in result.stdout
    for stage in ("step_tp", "generate"):
        assert f"== {stage}: skipped (--smoke)" in result.stdout
    rows = _summary_rows(out)
    # 4 step pairs (one model), 3 generate, save and load: all 9 listed.
    assert len(rows) == 9
    ran = [row for row in rows if row[4] != "not run (smoke)"]
    assert [row[:4] for row in ran] == [
        ["step", "transformer_small", "kd_dp", "torch_ddp"],
        ["checkpoint", "save", "kd", "dcp"],
        ["checkpoint", "load", "kd", "dcp"],
    ]
    for row in ran:
        _assert_numbers(row)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpu_fallback_fills_every_row(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", SCRIPT, "--device", "cpu", "--nproc", "2", "--quick"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for stage in ("step", "step_tp", "generate", "checkpoint", "report"):
        assert f"== {stage} ok (" in result.stdout
    rows = _summary_rows(out)
    # 4 step ratios (one model under --quick), 3 generate, save and load.
    assert len(rows) == 9
    for row in rows:
        _assert_numbers(row)
