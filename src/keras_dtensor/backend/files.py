"""Saves that appear whole: staged next to the target, moved into place.

A save writes into a hidden staging path next to its target (the same
directory, so the same filesystem), then moves it into place with a
rename: a reader finds the old file or the new one, never half of one. A
save killed in between leaves its staging path behind; the next save
removes it (`remove_leftovers`). Pure filesystem helpers: which rank
stages, and when, is the caller's.

Example:
>>> staging = files.staging_path("ckpt/epoch-3")
>>> os.mkdir(staging)  # ... the save writes into it ...
>>> files.move_into_place(staging, "ckpt/epoch-3")
"""

import contextlib
import glob
import os
import shutil
import uuid

__all__ = [
    "move_into_place",
    "remove_leftovers",
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
    """A hidden path next to `target` for a save to write into.

    Args:
        target: the path the save is for.
        token: what makes it unique (a `uuid4().hex`; a new one if
            `None`); ranks that share one staging path pass the same.

    Returns:
        The staging path (nothing is created).
    """
    directory, name = split(target)
    token = uuid.uuid4().hex if token is None else token
    return os.path.join(directory, f".{token}.{name}{_SUFFIX}")


def move_into_place(source, target) -> None:
    """Renames `source` to `target`, replacing what is there.

    A file replaces a file in one rename. A directory `source` replaces
    an existing `target` in two: the target is first moved aside next to
    `source`, and removed once `source` is in place.
    """
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


def remove_leftovers(directory, name: str | None = None) -> None:
    """Removes the staging paths killed saves left in `directory`.

    Args:
        directory: where the saves' targets are.
        name: only those of the target `name` (those of every target if
            `None`); staging paths of earlier versions of this package
            too.
    """
    escaped = glob.escape(os.fspath(directory))
    name = "*" if name is None else glob.escape(name)
    found = set()
    for pattern in _STAGING:
        base = os.path.join(escaped, pattern.format(token=_TOKEN, name=name))
        found.update(glob.glob(base) + glob.glob(base + _ASIDE))
    for path in sorted(found):
        _remove(path)
