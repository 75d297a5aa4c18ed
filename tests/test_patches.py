"""The hook table: install, uninstall (twice), exact restoration, gates."""

import importlib
import os
import subprocess
import sys
import types

import keras
import pytest

import keras_dtensor
from keras_dtensor import compat
from keras_dtensor import patches
from keras_dtensor.backend import distribution_lib
from keras_dtensor.patches import patch_kinds

# The attribute entries that apply to the installed Keras and torch.
ATTRIBUTES = [
    p
    for p in patches.PATCHES
    if isinstance(p, patch_kinds.Patch) and patch_kinds.applies(p)[0]
]


def _current(patch):
    return patch.owner().__dict__.get(patch.name, patch_kinds.MISSING)


@pytest.fixture
def reinstall():
    yield
    if not keras_dtensor.is_installed():
        keras_dtensor.install()


def _keras_own_distribution_lib():
    """What Keras itself binds: None on 3.15, its own module on 3.16."""
    if compat.keras_ships_torch_distribution():
        return importlib.import_module(
            "keras.src.backend.torch.distribution_lib"
        )
    return None


def _states():
    """{state} of the entries that apply to the installed versions."""
    return {
        state
        for _, state, _ in patches.status()
        if not state.startswith("skipped")
    }


def test_import_installs_every_row():
    assert keras_dtensor.is_installed()
    assert _states() == {"applied"}
    assert importlib.import_module("keras.src.backend").distribution_lib is (
        distribution_lib
    )
    dist_mod = importlib.import_module(
        "keras.src.distribution.distribution_lib"
    )
    assert dist_mod.distribution_lib is distribution_lib
    assert keras.distribution.list_devices() == ["cpu:0"]


def test_every_row_declares_the_versions_it_applies_to():
    # Each entry's ranges lie inside the supported ones; an entry applies
    # exactly when both installed versions are in its ranges, and info
    # names the reason of every skipped one.
    installed = {
        "keras": compat.keras_version(),
        "torch": compat.torch_version(),
    }
    states = dict((t, s) for t, s, _ in patches.status())
    for entry in patches.PATCHES:
        assert entry.why, entry.target
        inside = all(
            compat.contains(getattr(entry, p), v) for p, v in installed.items()
        )
        for package, supported, probes in (
            ("keras", compat.SUPPORTED_KERAS, ("3.14.9", "3.17.0")),
            ("torch", compat.SUPPORTED_TORCH, ("2.10.0", "2.16.0")),
        ):
            for outside in probes:
                assert not compat.contains(supported, outside)
                assert not compat.contains(getattr(entry, package), outside), (
                    entry.target
                )
        if inside:
            assert states[entry.target] == "applied", entry.target
        else:
            assert states[entry.target].startswith("skipped: applies to")
    for patch in ATTRIBUTES:
        # Wrapped functions keep the original they replaced.
        current = _current(patch)
        if callable(current) and hasattr(current, "__wrapped__"):
            assert getattr(current, patch_kinds.TAG) == patch.target


def test_uninstall_restores_originals_exactly(reinstall):
    before = {p.target: patches._ORIGINALS[p.target] for p in ATTRIBUTES}
    keras_dtensor.uninstall()
    assert not keras_dtensor.is_installed()
    for patch in ATTRIBUTES:
        owner, own, original, _ = before[patch.target]
        if own:
            assert _current(patch) is original, patch.target
        else:
            assert _current(patch) is patch_kinds.MISSING, patch.target
    assert (
        importlib.import_module("keras.src.backend").distribution_lib
        is _keras_own_distribution_lib()
    )
    keras_dtensor.uninstall()  # a second uninstall does nothing
    keras_dtensor.install()
    assert _states() == {"applied"}
    with pytest.warns(UserWarning, match="already installed"):
        keras_dtensor.install()
    assert _states() == {"applied"}


def test_uninstall_leaves_a_later_wrapper_alone(reinstall):
    patch = next(p for p in ATTRIBUTES if p.name == "_direct_assign")
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


@pytest.mark.parametrize("version", ["3.14.0", "3.17.0.dev0", "3.17.0"])
def test_unsupported_keras_touches_nothing(reinstall, monkeypatch, version):
    keras_dtensor.uninstall()
    monkeypatch.setattr(
        compat, "keras_version", lambda: compat.Version(version)
    )
    with pytest.raises(RuntimeError, match=r"supports keras<3.17,>=3.15") as e:
        keras_dtensor.install()
    assert "pip install 'keras<3.17,>=3.15'" in str(e.value)
    assert not keras_dtensor.is_installed()
    assert (
        importlib.import_module("keras.src.backend").distribution_lib
        is _keras_own_distribution_lib()
    )


def test_a_newer_torch_fails_at_install(reinstall, monkeypatch):
    # Outside the supported range install() refuses before touching
    # anything, naming the range and the pip command that fixes it.
    keras_dtensor.uninstall()
    monkeypatch.setattr(
        compat, "torch_version", lambda: compat.Version("2.16.0")
    )
    with pytest.raises(RuntimeError, match=r"supports torch<2.16,>=2.11") as e:
        keras_dtensor.install()
    assert "pip install 'torch<2.16,>=2.11'" in str(e.value)
    assert not keras_dtensor.is_installed()


def test_keras_nightly_version_is_read_from_the_imported_folder():
    # keras and keras-nightly install the same keras/ folder: the version
    # is the one `import keras` loads, whichever distribution owns it.
    assert compat.keras_version() == compat.Version(keras.__version__)


_HARMLESS = types.SimpleNamespace(value="original")


def test_install_is_all_or_nothing():
    # A target missing on this install: refused before any entry applies.
    good = patch_kinds.Patch(
        __name__, "_HARMLESS.value", "test", lambda original: "ours"
    )
    missing = patch_kinds.Patch(
        "keras.src.no_such_module", "thing", "test", lambda o: o
    )
    saved = {}
    with pytest.raises(RuntimeError, match="has no target"):
        patch_kinds.apply_all([good, missing], saved)
    assert _HARMLESS.value == "original" and not saved

    # An entry that fails while applying: the entries before it are put back.
    def fails(original):
        raise ValueError("factory failed")

    broken = patch_kinds.Patch(__name__, "_HARMLESS.other", "test", fails)
    with pytest.raises(ValueError, match="factory failed"):
        patch_kinds.apply_all([good, broken], saved)
    assert _HARMLESS.value == "original" and not saved


def test_a_row_outside_its_versions_is_skipped_not_applied():
    entry = patch_kinds.Patch(
        __name__,
        "_HARMLESS.value",
        "test",
        lambda original: "ours",
        keras="<3.0",
    )
    saved = {}
    patch_kinds.apply_all([entry], saved)
    assert _HARMLESS.value == "original" and not saved
    ((_, state, _),) = patch_kinds.status_of([entry], saved)
    assert state.startswith("skipped: applies to keras<3.0; installed ")


def _import_with(**env):
    """`import keras_dtensor` in a fresh process with `env` set."""
    return subprocess.run(
        [sys.executable, "-c", "import keras_dtensor"],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_non_torch_backend_is_a_clear_error():
    proc = _import_with(KERAS_BACKEND="jax")
    assert proc.returncode != 0
    assert "KERAS_BACKEND is 'jax'" in proc.stderr
    assert "Set KERAS_BACKEND=torch" in proc.stderr


_EXACT_RESTORE = r"""
import inspect
import sys

import keras
import torch.distributed.tensor  # noqa: F401
from torch.distributed.tensor import DTensor


def snapshot():
    # Every function and class attribute of Keras and DTensor, by identity,
    # and DTensor's sharding-rule tables. (Other parts of torch fill lazy
    # caches of their own as the workload runs.)
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(
            ("keras", "torch.distributed.tensor")
        ):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) or value is None:
                seen[(name, attr)] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    seen[(name, attr, key)] = id(member)
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = (
        "op_strategy_funcs",
        "op_to_schema_info",
        "op_to_rules",
        "op_single_dim_strategy_funcs",
    )
    for table in tables:
        for op, rule in getattr(propagator, table, {}).items():
            seen[(table, str(op))] = id(rule)
    return seen


before = snapshot()
before_modules = {k[0] for k in before}
import numpy as np

import keras_dtensor
from keras_dtensor.backend import object_state
from keras_dtensor.hooks import jit

x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
mesh = keras.distribution.DeviceMesh((1,), ["model"])
layouts = keras.distribution.LayoutMap(mesh)
layouts[".*kernel"] = (None, "model")
models = []
for distribution in (
    keras.distribution.ModelParallel(layout_map=layouts),
    keras.distribution.DataParallel(),
):
    with distribution.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, x[:, :2], epochs=1, verbose=0)
        jit._compile_forward(model)
    models.append(model)
assert object_state.status(), "the workload set no per-object attribute"
keras_dtensor.uninstall()
after = snapshot()
# torch adds single-dim rules lazily as ops first run (prims.fma): there,
# only what was before must be as before.
lazy = "op_single_dim_strategy_funcs"
changed = sorted(
    str(k) for k in before.keys() | after.keys()
    if after.get(k) != before.get(k)
    and (k in before or (k[0] in before_modules and k[0] != lazy))
)
assert not changed, changed
for model in models:
    ours = [a for a in vars(model) if "keras_dtensor" in a]
    assert not ours and "call" not in vars(model), ours
    assert not hasattr(model.train_function, "__keras_dtensor_patch__")
assert not object_state.status()
print("EXACT")
"""


def test_uninstall_leaves_keras_and_torch_as_before_install():
    # A fresh process: the snapshot is taken before keras_dtensor is
    # imported, then a workload runs under ModelParallel and DataParallel
    # (per-object attributes, compiled forward), then uninstall().
    env = dict(os.environ, KERAS_BACKEND="torch")
    proc = subprocess.run(
        [sys.executable, "-c", _EXACT_RESTORE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EXACT" in proc.stdout


def test_a_bad_environment_variable_is_a_clear_error_at_import():
    proc = _import_with(KERAS_BACKEND="torch", KERAS_DTENSOR_TIMEOUT="soon")
    assert proc.returncode != 0
    assert "KERAS_DTENSOR_TIMEOUT='soon' is not valid" in proc.stderr
    assert "seconds > 0" in proc.stderr


def test_config_parses_every_variable(monkeypatch):
    from keras_dtensor import config

    for variable in config.SETTINGS:
        monkeypatch.delenv(variable.env, raising=False)
        assert config.get(variable.name) == variable.default
    monkeypatch.setenv("KERAS_DTENSOR_LOG_ALL_RANKS", "yes")
    monkeypatch.setenv("KERAS_DTENSOR_SPLIT_UPDATE", "0")
    monkeypatch.setenv("KERAS_DTENSOR_BUCKET_MB", "0.5")
    assert config.get("LOG_ALL_RANKS") is True
    assert config.get("SPLIT_UPDATE") is False
    assert config.get("BUCKET_MB") == 0.5
    monkeypatch.setenv("KERAS_DTENSOR_SPLIT_UPDATE", "maybe")
    with pytest.raises(ValueError, match="KERAS_DTENSOR_SPLIT_UPDATE="):
        config.check()


def test_per_object_attributes_do_not_keep_their_object_alive():
    # A model's wrapped step function refers back to the model: the record
    # of what it replaced must not keep a dropped model (and its weights)
    # alive.
    import functools
    import gc
    import weakref

    from keras_dtensor.backend import object_state

    class Model:
        pass

    model = Model()
    object_state.set_on(model, "step", functools.partial(id, model))
    assert ("Model", "step") in object_state.status()
    assert object_state.get_on(model, "step") is model.step
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    assert ("Model", "step") not in object_state.status()


def test_supported_ranges_move_together():
    # pyproject.toml's dependencies, compat's gates and the README's table
    # name the same ranges.
    import pathlib

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    root = pathlib.Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    declared = {
        r.name: r.specifier
        for r in map(Requirement, project["project"]["dependencies"])
    }
    assert declared["keras"] == compat.SUPPORTED_KERAS
    assert declared["torch"] == compat.SUPPORTED_TORCH
    readme = (root / "README.md").read_text(encoding="utf-8")
    for name, spec in declared.items():
        if name in ("keras", "torch"):
            ordered = ",".join(sorted(str(spec).split(","), reverse=True))
            assert f"| {name} | `{ordered}` (checked at import)" in readme
