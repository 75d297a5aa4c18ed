"""`scripts/gpu_check.sh`, the one command for a multi-GPU machine.

It cannot run here on CUDA; its CPU fallback (`--device cpu --quick`) runs
the same stages over gloo, so a renamed flag, a changed JSON or a broken
stage shows up before someone spends GPU time on it. The whole run is 13
fresh torchrun launches (minutes on 2 cores): `slow`. The fast tests check
the flags the script passes and that a missing stage fails the report.
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


def test_cuda_without_gpus_is_refused(tmp_path):
    result = subprocess.run(
        ["bash", SCRIPT, "--device", "cuda", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**_env(), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2
    assert "no GPU visible" in result.stderr


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
    rows = [
        line.strip("|").split("|")
        for line in (out / "summary.md").read_text().splitlines()
        if re.match(r"\| (step|generate|checkpoint) ", line)
    ]
    # 4 step ratios (one model under --quick), 2 generate, save and load.
    assert len(rows) == 8
    for row in rows:
        procs, *numbers = (cell.strip() for cell in row[4:])
        assert procs == "2" or row[2].strip() == "keras_single", row
        for number in numbers:
            float(number)  # "missing" (or an empty cell) raises
        assert len(numbers) == 4, row
