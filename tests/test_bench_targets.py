"""The benchmark's target arithmetic: ratios paired within rounds.

No processes: `benchmarks/bench_step.py` is loaded as a module (its
sibling modules found on `benchmarks/`, as when the script runs) and its
summary is computed from made-up per-round medians.
"""

import importlib.util
import os
import types

import pytest

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def bench():
    folder = os.path.join(HERE, os.pardir, "benchmarks")
    path = os.path.join(folder, "bench_step.py")
    spec = importlib.util.spec_from_file_location("bench_step", path)
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(folder)
        spec.loader.exec_module(module)
    return module


def _rows(per_round):
    return {
        variant: {
            "median_ms": sorted(ms)[len(ms) // 2],
            "round_median_ms": ms,
            "bytes_per_rank": 100,
        }
        for variant, ms in per_round.items()
    }


def test_ratios_are_paired_within_rounds(bench):
    # Round 2 runs everything twice as slow: pooled medians would mix the
    # rounds, paired ratios do not.
    rows = _rows(
        {
            "torch_single": [10.0, 20.0, 10.0],
            "keras_single": [15.0, 30.0, 15.0],
            "torch_ddp": [20.0, 40.0, 20.0],
            "kd_dp": [28.0, 64.0, 28.0],
        }
    )
    targets = bench._targets(rows, types.SimpleNamespace(nproc=2))
    single = targets["keras_over_torch_single"]
    assert single["per_round"] == [1.5, 1.5, 1.5]
    assert single["extra_ms_per_round"] == [5.0, 10.0, 5.0]
    dp = targets["kd_dp_over_ddp"]
    assert dp["per_round"] == [1.4, 1.6, 1.4]
    assert dp["median_of_rounds"] == 1.4
    assert dp["holds_in_rounds"] == "2/3"  # 1.6 > 1.5 in round 2
    assert dp["extra_holds"] == "0/3"  # 8 > 5, 24 > 10, 8 > 5
    assert "holds_in_rounds_vs_local" not in dp  # no local references ran
    assert "kd_mp_over_tp" not in targets


def test_per_process_batch_references(bench):
    rows = _rows(
        {
            "torch_single": [10.0, 10.0],
            "keras_single": [11.0, 11.0],
            "torch_single_local": [5.0, 5.0],
            "keras_single_local": [7.5, 7.5],
            "torch_single_pair": [6.0, 6.0],
            "keras_single_pair": [9.0, 10.2],
            "torch_tp": [8.0, 8.0],
            "kd_mp": [10.0, 12.8],
        }
    )
    targets = bench._targets(rows, types.SimpleNamespace(nproc=2))
    mp = targets["kd_mp_over_tp"]
    assert mp["holds_in_rounds"] == "0/2"  # 1.25, 1.6 vs 1.1
    assert mp["holds_in_rounds_vs_local"] == "1/2"  # 1.25, 1.6 vs 1.5
    assert mp["holds_in_rounds_vs_pair"] == "2/2"  # 1.25, 1.6 vs 1.5, 1.7
    assert mp["extra_holds_vs_pair"] == "1/2"  # 2, 4.8 vs 3, 4.2
    assert bench._held(mp, "holds_in_rounds") == "0/2 / 1/2 / 2/2"
    del rows["torch_single_pair"], rows["keras_single_pair"]
    targets = bench._targets(rows, types.SimpleNamespace(nproc=2))
    assert bench._held(targets["kd_mp_over_tp"], "holds_in_rounds") == (
        "0/2 / 1/2 / -"
    )


def test_no_collectives_pairs_are_held_against_keras(bench):
    # The diagnostics' pairs are read against Keras's own overhead like the
    # real ones, each within its round.
    rows = _rows(
        {
            "torch_single": [10.0, 10.0],
            "keras_single": [14.0, 16.0],
            "torch_ddp": [12.0, 12.0],
            "kd_dp": [20.0, 20.0],
            "torch_ddp_no_collectives": [11.0, 11.0],
            "kd_dp_no_collectives": [13.0, 18.0],
        }
    )
    targets = bench._targets(rows, types.SimpleNamespace(nproc=2))
    assert targets["kd_dp_over_ddp"]["extra_holds"] == "0/2"  # 8 > 4, 6
    off = targets["kd_dp_over_ddp_no_collectives"]
    assert off["extra_ms_per_round"] == [2.0, 7.0]
    assert off["extra_holds"] == "1/2"  # 2 <= 4, 7 > 6
