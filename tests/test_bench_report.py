"""BENCHMARKS.md is `benchmarks/report.py`'s output, figures from the data.

No processes: the generator is loaded as a module and run on the results
files into memory.
"""

import importlib.util
import os
import re

import pytest

HERE = os.path.dirname(__file__)
ROOT = os.path.join(HERE, os.pardir)
BENCHMARKS = os.path.abspath(os.path.join(ROOT, "benchmarks"))
# Prose fields of results-history.json: descriptions, not measurements.
PROSE = {"about", "what", "source", "command", "note", "case", "check"}
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


@pytest.fixture(scope="module")
def report():
    path = os.path.join(BENCHMARKS, "report.py")
    spec = importlib.util.spec_from_file_location("report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _values(node, key=None):
    """Every number and data string in the results, prose left out."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k not in PROSE:
                yield from _values(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _values(v, key)
    elif isinstance(node, bool) or node is None:
        return
    else:
        yield node


def _spellings(data):
    found = set()
    for value in _values(data):
        if isinstance(value, str):
            found.update(NUMBER.findall(value))
        else:
            found.update(f"{value:.{d}f}" for d in range(4))
            if float(value).is_integer():
                found.add(str(int(value)))
    return found


def test_benchmarks_md_is_the_generators_output(report, tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--out", str(out)]) == 0
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        committed = f.read()
    assert out.read_text() == committed, (
        "BENCHMARKS.md differs from the generator's output: edit the "
        "results files, then run `python benchmarks/report.py`"
    )
    assert report.HEADER in committed.splitlines()[2]


def test_headline_figures_come_from_the_results(report):
    data = report.load()
    table = report.headline(data)
    assert len(table) > 2
    known = _spellings(data)
    missing = [
        (line.split("|")[3].strip(), token)
        for line in table[2:]
        for token in NUMBER.findall(line)
        if token not in known
    ]
    assert not missing, f"headline figures not in any results file: {missing}"


def test_newest_run_wins(report):
    data = report.load()
    found = report.latest(data)
    # results-targets.json also measured kd-DP and kd-MP; newer runs in
    # results-history.json supersede it.
    files = data["results-history.json"]["files"]
    _, run = found["mlp", "kd_dp_over_ddp"]
    assert run["date"] > files["results-targets.json"]["date"]
    runs = report.step_runs(data)
    assert [run["date"] for run in runs] == sorted(r["date"] for r in runs)


def test_every_run_is_printed(report):
    data = report.load()
    history = data["results-history.json"]
    areas = {k for k, v in history.items() if isinstance(v, list)}
    printed = {s for _, group in report.SECTIONS for s in group}
    assert printed == (set(data) - {"results-history.json"}) | areas


def test_every_table_figure_comes_from_the_results(report):
    data = report.load()
    text = report.build(data)
    runs = text.split("\n## Method\n")[1].split("\n## ", 1)[1]
    # Row labels: the results' keys and cases, and the writer's LABELS.
    labels = [*_keys(data), *_cases(data), *report.LABELS.values()]
    known = _spellings(data) | _spellings(labels)
    missing = [
        (line[:60], token)
        for line in runs.splitlines()
        if line.startswith("|")
        for token in NUMBER.findall(line)
        if token not in known
    ]
    assert not missing, f"figures not in any results file: {missing}"


def _walk(node):
    """Every (key, value) pair in the results, at any depth."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _keys(data):
    return [k for k, _ in _walk(data)]


def _cases(data):
    return [v for k, v in _walk(data) if k == "case"]
