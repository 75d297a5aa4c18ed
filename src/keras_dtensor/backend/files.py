"""Saves that appear whole: staged next to the target, moved into place;
the next save cleans up or puts back what a killed one left.
"""

import contextlib
import glob
import os
import shutil
import tempfile
import uuid

__all__ = [
    "in_place_or_aside",
    "move_into_place",
    "remove_dead_scratch",
    "remove_leftovers",
    "scratch_dir",
    "split",
    "staging_path",
]

_TOKEN = "[0-9a-f]" * 32  # a `uuid4().hex`
_SUFFIX = ".partial"
_ASIDE = ".old"  # a directory target moved aside while it is replaced
# Staging names, by glob: this version's first, then earlier versions'.
_STAGING = (
    ".{token}.{name}" + _SUFFIX,
    ".{name}.{token}" + _SUFFIX,
    ".{token}.{name}.d",
    ".{token}.{name}",
)


def split(target) -> tuple[str, str]:
    """`(directory, name)` of a target path (`"."` for a bare name)."""
    final = os.fspath(target)
    return os.path.dirname(final) or ".", os.path.basename(final)


def staging_path(target, token: str | None = None) -> str:
    """A hidden path next to `target`, unique by `token` (or a new one)."""
    directory, name = split(target)
    token = uuid.uuid4().hex if token is None else token
    return os.path.join(directory, f".{token}.{name}{_SUFFIX}")


def move_into_place(source, target) -> None:
    """Renames `source` to `target`; an old directory goes aside first."""
    source, target = os.fspath(source), os.fspath(target)
    aside = None
    if os.path.isdir(source) and os.path.lexists(target):
        aside = source + _ASIDE
        os.replace(target, aside)
    os.replace(source, target)
    if aside is not None:
        _remove(aside)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def _orphans(directory):
    """`{target name: aside path}` of targets moved aside, not replaced."""
    tail = _SUFFIX + _ASIDE
    escaped = glob.escape(os.fspath(directory))
    out = {}
    for path in sorted(glob.glob(os.path.join(escaped, f".{_TOKEN}.?*{tail}"))):
        name = os.path.basename(path)[34 : -len(tail)]  # after ".<token>."
        if not os.path.lexists(os.path.join(directory, name)):
            out[name] = path
    return out


def in_place_or_aside(directory) -> dict[str, str]:
    """`{name: path}` of visible entries and of targets left aside."""
    out = {
        entry: os.path.join(directory, entry)
        for entry in os.listdir(directory)
        if not entry.startswith(".")
    }
    out.update(_orphans(directory))
    return out


def remove_leftovers(directory, name: str | None = None) -> None:
    """Undoes what killed saves of `name` (or all) left, and dead scratch."""
    for target, aside in _orphans(directory).items():
        if name is None or target == name:
            with contextlib.suppress(OSError):
                os.replace(aside, os.path.join(directory, target))
    escaped = glob.escape(os.fspath(directory))
    name = "*" if name is None else glob.escape(name)
    found = set()
    for pattern in _STAGING:
        base = os.path.join(escaped, pattern.format(token=_TOKEN, name=name))
        found.update(glob.glob(base) + glob.glob(base + _ASIDE))
    for path in sorted(found):
        _remove(path)
    remove_dead_scratch()


_SCRATCH = "keras_dtensor_save_"


def scratch_dir() -> str:
    """A new private temporary directory named with this process's id."""
    return tempfile.mkdtemp(prefix=f"{_SCRATCH}{os.getpid()}_")


def remove_dead_scratch() -> None:
    """Removes the scratch directories of processes that no longer run."""
    pattern = os.path.join(glob.escape(tempfile.gettempdir()), _SCRATCH + "*")
    for path in glob.glob(pattern):
        pid = os.path.basename(path)[len(_SCRATCH) :].partition("_")[0]
        if pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                _remove(path)
            except OSError:  # another user's process
                pass
