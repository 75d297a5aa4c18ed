"""Every ```python block of README.md and docs/ runs.

A block that uses `keras.distribution` runs on 2 real processes (one
`run_ranks` call for all of them), any other in one plain process (one
subprocess for all of them). Each block gets a fresh namespace and a fresh
working directory; the distribution and Keras's session are reset between
blocks. A block that cannot run here (a download, a GPU, a fragment of
another block) is preceded by `<!-- no-run: reason -->`: it shows up as a
skipped test with its reason. Shell blocks are not run.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
import traceback

import pytest
from harness import run_ranks

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:(?P<reason>.*?)-->\s*$")
DISTRIBUTED = "keras.distribution"
WORLD = 2


def _markdown_files():
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def parse_blocks(text, name):
    """The fenced code blocks of a Markdown text.

    Args:
        text: the Markdown.
        name: the file's name, for block ids.

    Returns:
        A list of dicts: `id` (`name:line`), `lang`, `code` (dedented),
        `skip` (the no-run reason, or `None`).
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, indent = i, match["indent"]
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :])
            i += 1
        previous = start - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        marker = NO_RUN.match(lines[previous]) if previous >= 0 else None
        blocks.append(
            {
                "id": f"{name}:{start + 1}",
                "lang": match["lang"],
                "code": textwrap.dedent("\n".join(body)) + "\n",
                "skip": marker["reason"].strip() if marker else None,
            }
        )
        i += 1
    return blocks


def _all_blocks():
    blocks = []
    for path in _markdown_files():
        name = str(path.relative_to(ROOT))
        blocks += parse_blocks(path.read_text(encoding="utf-8"), name)
    return blocks


def _markers():
    """Every no-run marker, with the language of the block it precedes."""
    found = []
    for path in _markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        name = str(path.relative_to(ROOT))
        for i, line in enumerate(lines):
            if NO_RUN.match(line):
                following = next(
                    (x for x in lines[i + 1 :] if x.strip()), ""
                ).strip()
                found.append((f"{name}:{i + 1}", following))
    return found


BLOCKS = [b for b in _all_blocks() if b["lang"] == "python"]
RUN = [b for b in BLOCKS if b["skip"] is None]
SKIPPED = [b for b in BLOCKS if b["skip"] is not None]
DIST = [b for b in RUN if DISTRIBUTED in b["code"]]
LOCAL = [b for b in RUN if DISTRIBUTED not in b["code"]]


def exec_blocks(blocks, stop_on_error, shared=None):
    """Runs each block in a fresh namespace and directory.

    Args:
        blocks: the blocks to run, in order.
        stop_on_error: raise on the first failing block (peers would
            otherwise wait on its collectives).
        shared: a directory every rank sees; each block runs in its own
            folder there (a save is written by one rank, read by all).

    Returns:
        `[(block id, None or the traceback and output)]`.
    """
    import keras

    import keras_dtensor

    results = []
    home = os.getcwd()
    for index, block in enumerate(blocks):
        buffer = io.StringIO()
        error = None
        with tempfile.TemporaryDirectory() as tmp:
            if shared is not None:
                tmp = os.path.join(shared, str(index))
                os.makedirs(tmp, exist_ok=True)
            os.chdir(tmp)
            try:
                code = compile(block["code"], block["id"], "exec")
                with contextlib.redirect_stdout(buffer):
                    exec(code, {"__name__": "__main__"})  # noqa: S102
            except BaseException:  # noqa: B036 - report, then go on
                error = traceback.format_exc() + buffer.getvalue()[-2000:]
            finally:
                os.chdir(home)
                keras.distribution.set_distribution(None)
                keras.backend.clear_session()
                if not keras_dtensor.is_installed():
                    keras_dtensor.install()
        if error and stop_on_error:
            raise RuntimeError(f"{block['id']} failed:\n{error}")
        results.append((block["id"], error))
    return results


def _ranks_fn(blocks, shared):
    return [block_id for block_id, _ in exec_blocks(blocks, True, shared)]


def _local_main(path):
    # In a fresh plain interpreter: no launcher, no process group.
    with open(path) as f:
        blocks = json.load(f)
    with open(path, "w") as f:
        json.dump(exec_blocks(blocks, False), f)


def _format(failures):
    return "\n\n".join(f"{block_id}:\n{error}" for block_id, error in failures)


SENTINEL = {
    "id": "sentinel",
    "lang": "python",
    "code": "raise RuntimeError('a broken block must fail the test')\n",
    "skip": None,
}


def test_single_process_blocks(tmp_path):
    # The sentinel checks that a failing block is reported as failed.
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps([*LOCAL, SENTINEL]))
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(name, None)
    here = str(pathlib.Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [here, env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    command = (
        "import sys; sys.modules.setdefault('tensorflow', None); "
        f"import test_docs; test_docs._local_main({str(path)!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(path.read_text())
    assert [r[0] for r in results] == [b["id"] for b in [*LOCAL, SENTINEL]]
    failures = [r for r in results[:-1] if r[1] is not None]
    assert not failures, _format(failures)
    assert results[-1][1] is not None, "a broken block was not reported"


@pytest.mark.multiprocess
def test_distributed_blocks(tmp_path):
    assert DIST, "no block uses keras.distribution"
    ids = run_ranks(_ranks_fn, WORLD, DIST, str(tmp_path))
    assert ids == [[b["id"] for b in DIST]] * WORLD


def test_markers_precede_python_blocks():
    # A marker on anything but a python block hides nothing: a typo.
    for where, following in _markers():
        assert following == "```python", f"{where}: no-run before {following}"
    assert len(_markers()) == len(SKIPPED)
    for block in SKIPPED:
        assert block["skip"], f"{block['id']}: no-run needs a reason"


def test_blocks_are_found():
    assert len(RUN) + len(SKIPPED) == len(BLOCKS)
    assert any(b["id"].startswith("README.md") for b in RUN)


@pytest.mark.parametrize(
    "block", SKIPPED, ids=[b["id"] for b in SKIPPED] or None
)
def test_no_run_block(block):
    pytest.skip(f"no-run: {block['skip']}")


def test_configuration_lists_every_variable():
    source = (ROOT / "src" / "keras_dtensor" / "config.py").read_text()
    names = re.findall(r'Setting\(\s*"(\w+)"', source)
    assert names, "no Setting entries found in config.py"
    table = (ROOT / "docs" / "guides" / "configuration.md").read_text()
    missing = [n for n in names if f"`KERAS_DTENSOR_{n}`" not in table]
    assert not missing, f"docs/guides/configuration.md lacks {missing}"


def test_readme_links_exist():
    # mkdocs checks the links inside docs/; README.md is outside it.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}"
