"""The hook table: install, uninstall (twice), exact restoration, gates."""

import importlib
import os
import subprocess
import sys

import keras
import pytest
from packaging.specifiers import SpecifierSet

import keras_dtensor
from keras_dtensor import compat
from keras_dtensor import distribution_lib
from keras_dtensor import patches


def _current(patch):
    return patch.owner().__dict__.get(patch.name, patches._MISSING)


@pytest.fixture
def reinstall():
    yield
    if not keras_dtensor.is_installed():
        keras_dtensor.install()


def test_import_installs_every_row():
    assert keras_dtensor.is_installed()
    assert {state for _, state, _ in patches.status()} == {"applied"}
    assert importlib.import_module("keras.src.backend").distribution_lib is (
        distribution_lib
    )
    dist_mod = importlib.import_module(
        "keras.src.distribution.distribution_lib"
    )
    assert dist_mod.distribution_lib is distribution_lib
    assert keras.distribution.list_devices() == ["cpu:0"]


def test_table_matches_installed_keras():
    version = compat.keras_version()
    for patch in patches.PATCHES:
        assert version in SpecifierSet(patch.keras), patch.target
        assert patch.why, patch.target
        # Wrapped functions keep the original they replaced.
        current = _current(patch)
        if callable(current) and hasattr(current, "__wrapped__"):
            assert getattr(current, patches._TAG) == patch.target


def test_uninstall_restores_originals_exactly(reinstall):
    before = {p.target: patches._ORIGINALS[p.target] for p in patches.PATCHES}
    keras_dtensor.uninstall()
    assert not keras_dtensor.is_installed()
    for patch in patches.PATCHES:
        owner, own, original, _ = before[patch.target]
        if own:
            assert _current(patch) is original, patch.target
        else:
            assert _current(patch) is patches._MISSING, patch.target
    assert importlib.import_module("keras.src.backend").distribution_lib is None
    keras_dtensor.uninstall()  # a second uninstall does nothing
    keras_dtensor.install()
    assert {state for _, state, _ in patches.status()} == {"applied"}
    with pytest.warns(UserWarning, match="already installed"):
        keras_dtensor.install()
    assert {state for _, state, _ in patches.status()} == {"applied"}


def test_uninstall_leaves_a_later_wrapper_alone(reinstall):
    patch = next(p for p in patches.PATCHES if p.name == "_direct_assign")
    ours = _current(patch)

    def theirs(self, value):
        return ours(self, value)

    setattr(patch.owner(), patch.name, theirs)
    assert dict((t, s) for t, s, _ in patches.status())[patch.target] == (
        "replaced by another library"
    )
    with pytest.warns(UserWarning, match="replaced again"):
        keras_dtensor.uninstall()
    assert _current(patch) is theirs
    setattr(patch.owner(), patch.name, ours.__wrapped__)


def test_unsupported_keras_touches_nothing(reinstall, monkeypatch):
    keras_dtensor.uninstall()
    monkeypatch.setattr(
        compat, "keras_version", lambda: compat.Version("3.14.0")
    )
    with pytest.raises(RuntimeError, match=r"supports keras<3.16,>=3.15"):
        keras_dtensor.install()
    assert not keras_dtensor.is_installed()
    assert importlib.import_module("keras.src.backend").distribution_lib is None


def test_non_torch_backend_is_a_clear_error():
    env = dict(os.environ, KERAS_BACKEND="jax")
    proc = subprocess.run(
        [sys.executable, "-c", "import keras_dtensor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "KERAS_BACKEND is 'jax'" in proc.stderr
    assert "Set KERAS_BACKEND=torch" in proc.stderr
