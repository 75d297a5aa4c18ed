"""The command line and real torchrun launches (env:// rendezvous)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

HERE = os.path.dirname(__file__)


def _run(args, env=None, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env
    )


def _torchrun(script, env=None, *options):
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *options,
            script,
        ],
        env=env,
    )


def test_info_lists_versions_and_every_hook():
    import keras
    import torch

    from keras_dtensor import patches

    proc = _run([sys.executable, "-m", "keras_dtensor.cli", "info"])
    assert proc.returncode == 0, proc.stderr
    assert f"keras         {keras.__version__}" in proc.stdout
    assert f"torch         {torch.__version__}" in proc.stdout
    assert "keras_hub     " in proc.stdout
    assert "keras's own   torch distribution: " in proc.stdout
    assert "rank 0 of 1" in proc.stdout
    # Every row: applied, or skipped with the versions it applies to.
    for target, state, _ in patches.status():
        assert f"[{state}] {target}" in proc.stdout
        assert state == "applied" or state.startswith("skipped: applies to")


def test_demo_trains_on_two_processes_with_parity():
    proc = _run(
        [sys.executable, "-m", "keras_dtensor.cli", "demo", "--epochs", "2"]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # Per-epoch loss from rank 0 only.
    assert out.count("epoch 1: loss") == 1 and out.count("epoch 2: loss") == 1
    assert "attention/query/kernel" in out and "(32, 2, 8)" in out
    assert "parity vs one process" in out and "(OK," in out


def test_torchrun_without_initialize_starts_the_group_lazily(tmp_path):
    proc = _torchrun(
        os.path.join(HERE, "scripts", "lazy_train.py"),
        env={"RESULT_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    ]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["devices"] == ["cpu:0", "cpu:1"] for r in results)
    assert results[0]["seed"] is not None
    assert results[0]["seed"] == results[1]["seed"]
    assert results[0]["loss"] == results[1]["loss"]


def _placement_order(hash_seed, uninstall):
    code = (
        "import keras_dtensor\n"
        "from keras_dtensor.backend import placement_order\n"
        + ("keras_dtensor.uninstall()\n" if uninstall else "")
        + "print(placement_order.order_digest())"
    )
    proc = _run(
        [sys.executable, "-c", code], env={"PYTHONHASHSEED": str(hash_seed)}
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


def test_placement_order_is_the_same_whatever_the_hash_seed():
    # Hash seeds 0 and 1 order a set of Partial placements differently
    # with torch's own hashes (the control), the same with ours.
    assert _placement_order(0, uninstall=True) != _placement_order(
        1, uninstall=True
    )
    assert _placement_order(0, uninstall=False) == _placement_order(
        1, uninstall=False
    )


def test_plain_torchrun_without_a_hash_seed_trains_model_parallel(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(HERE, "scripts", "plain_torchrun_mp.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(env, OMP_NUM_THREADS="1", RESULT_DIR=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    ]
    # The ranks did hash strings differently...
    assert results[0]["string_hash"] != results[1]["string_hash"]
    # ...yet agree, and equal one device.
    for r in results:
        assert r["loss"] == r["reference_loss"]
        assert r["max_weight_diff"] < 1e-6


def test_run_launcher_restarts_a_failed_job_with_a_fresh_store_prefix(
    tmp_path,
):
    proc = _run(
        [
            sys.executable,
            "-m",
            "keras_dtensor.cli",
            "run",
            "-n",
            "2",
            "--max-restarts",
            "1",
            os.path.join(HERE, "scripts", "lazy_train.py"),
        ],
        env={"RESULT_DIR": str(tmp_path), "FAIL_FIRST_ATTEMPT": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    ]
    assert [r["restart"] for r in results] == [1, 1]
    assert results[0]["loss"] == results[1]["loss"]


def test_two_nodes_of_two_processes_on_loopback(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-nodes",
        os.path.join(HERE, "scripts", "lazy_train.py"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", RESULT_DIR=str(tmp_path))
    nodes = [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    results = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)
    ]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["devices"] == [f"cpu:{i}" for i in range(4)] for r in results)
    assert all(r["loss"] == results[0]["loss"] for r in results)


def test_plan_a_keras_hub_backbone_without_allocating():
    config = (
        '{"vocabulary_size": 1000, "num_layers": 2, "num_query_heads": 4, '
        '"num_key_value_heads": 4, "hidden_dim": 64, "intermediate_dim": 256, '
        '"head_dim": 16}'
    )
    proc = _run(
        [
            sys.executable,
            "-m",
            "keras_dtensor.cli",
            "plan",
            "--keras-hub",
            "GemmaBackbone",
            "--config",
            config,
            "--mesh",
            "1,2",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    # (1000, 64) over "model" (2): 500 rows of 64 float32 per rank.
    assert "| token_embedding/embeddings | (1000, 64) |" in proc.stdout
    assert "(500, 64) | 0.12 |" in proc.stdout
    assert "weights + optimizer slots per rank:" in proc.stdout
