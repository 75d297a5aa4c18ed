"""The supported Keras and torch releases, and where Keras keeps what we hook.

One code base serves Keras 3.15.x and 3.16 (released or `keras-nightly`),
and torch 2.11 through 2.15 (`make test` runs the suite on the first line,
`make test-next` on the second). Three things vary between them, all
answered here, so nothing else tests a version:

- **The supported ranges.** `check_environment()` refuses, at import, a
  Keras or torch outside them, with the range and the pip command that
  fixes it: never a wrong number later.
- **The installed versions.** Keras's version is read from the `keras/`
  folder that `import keras` loads, not from a distribution's metadata:
  `keras` and `keras-nightly` install the same folder, and either may own it.
- **Where a Keras name lives.** Keras 3.16 moved the torch backend's `core`,
  `numpy` and `nn` under `backend/torch/ops/`, renamed `TorchTrainer` to
  `Trainer` and the base `Trainer` to `BaseTrainer`. `KERAS` maps each
  name the package uses to its place on the installed Keras.

Keras 3.16 also ships a torch distribution of its own
(`keras.src.backend.torch.distribution_lib`); `keras_ships_torch_distribution()`
tells, and the table's entries that take its place declare `keras>=3.16`.
"""

import functools
import importlib
import importlib.util
import os
import re
import types

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "KERAS",
    "KERAS_3_15",
    "KERAS_3_16",
    "SUPPORTED_KERAS",
    "SUPPORTED_TORCH",
    "Version",
    "base_trainer_class",
    "check_environment",
    "contains",
    "keras_hub_version",
    "keras_module",
    "keras_ships_torch_distribution",
    "keras_version",
    "torch_core",
    "torch_trainer_class",
    "torch_version",
]

# Keep in step with pyproject.toml's dependencies and the README's table.
# (A Keras 3.16 development build, `keras-nightly`, is inside.)
SUPPORTED_KERAS = SpecifierSet(">=3.15,<3.17")
SUPPORTED_TORCH = SpecifierSet(">=2.11,<2.16")

# The first Keras whose torch backend has the 3.16 layout, and the ranges of
# entries that apply to one release line only.
_KERAS_3_16 = Version("3.16.0.dev0")
KERAS_3_15 = ">=3.15,<3.16.0.dev0"
KERAS_3_16 = ">=3.16.0.dev0,<3.17"


def contains(spec, version) -> bool:
    """`version in spec`, pre-releases included (keras-nightly: 3.16.0.devN)."""
    return SpecifierSet(str(spec)).contains(version, prereleases=True)


@functools.cache
def keras_version() -> Version:
    """The version of the Keras that `import keras` loads, without importing it.

    Read from `keras/src/version.py` in the folder Python would import:
    `keras` and `keras-nightly` both install that folder, and the metadata
    of either may be present whichever owns it now.
    """
    spec = importlib.util.find_spec("keras")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, "src", "version.py")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    found = re.search(
                        r"""__version__\s*=\s*["']([^"']+)["']""", f.read()
                    )
                if found:
                    return Version(found.group(1))
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    for name in ("keras", "keras-nightly"):
        try:
            return Version(version(name))
        except PackageNotFoundError:
            continue
    raise RuntimeError(
        f"keras_dtensor needs Keras: pip install 'keras{SUPPORTED_KERAS}'."
    )


def torch_version() -> Version:
    """The installed torch version, without its local part (`+cpu`)."""
    import torch

    return Version(torch.__version__.split("+")[0])


def keras_hub_version():
    """The installed keras_hub version, or `None`."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    for name in ("keras-hub", "keras-hub-nightly"):
        try:
            return Version(version(name))
        except PackageNotFoundError:
            continue
    return None


def _keras_paths(version):
    new = version >= _KERAS_3_16
    ops = "keras.src.backend.torch.ops" if new else "keras.src.backend.torch"
    return types.SimpleNamespace(
        # The torch backend's modules.
        torch_core=f"{ops}.core",
        torch_numpy=f"{ops}.numpy",
        torch_nn=f"{ops}.nn",
        # The module that re-exports torch_core's functions (`from core
        # import *`) for `keras.src.backend.ops` (3.16) or `backend` (3.15).
        torch_ops=ops,
        # Classes of the trainers: (module, name).
        torch_trainer="Trainer" if new else "TorchTrainer",
        # Its method that decides whether `jit_compile` compiles the step.
        should_compile="_use_torch_compile" if new else "_should_torch_compile",
        base_trainer="BaseTrainer" if new else "Trainer",
    )


KERAS = _keras_paths(keras_version())


def keras_module(name):
    """The installed Keras's module for one of `KERAS`'s names.

    Example:
    >>> keras_module("torch_core").convert_to_tensor([1.0])
    """
    return importlib.import_module(getattr(KERAS, name))


def torch_core():
    """Keras's torch backend `core` module (`Variable`, `convert_to_tensor`)."""
    return keras_module("torch_core")


def torch_trainer_class():
    """Keras's torch trainer class (`TorchTrainer`, `Trainer` on 3.16)."""
    module = importlib.import_module("keras.src.backend.torch.trainer")
    return getattr(module, KERAS.torch_trainer)


def base_trainer_class():
    """Keras's backend-agnostic trainer (`Trainer`, `BaseTrainer` on 3.16)."""
    module = importlib.import_module("keras.src.trainers.trainer")
    return getattr(module, KERAS.base_trainer)


# Keras's data adapters that hooks tell apart: class name -> module.
_ADAPTERS = {
    "TorchDataLoaderAdapter": "torch_data_loader_adapter",
    "PyDatasetAdapter": "py_dataset_adapter",
    "TFDatasetAdapter": "tf_dataset_adapter",
}


def data_adapter_class(name):
    """One of Keras's data adapter classes (`_ADAPTERS`), by name."""
    module = importlib.import_module(
        f"keras.src.trainers.data_adapters.{_ADAPTERS[name]}"
    )
    return getattr(module, name)


def check_environment():
    """Raises a clear error unless Keras and torch are supported.

    Raises:
        RuntimeError: the Keras backend is not torch, or the Keras or torch
            version is outside the supported range (with the pip command
            that installs a supported one).
    """
    backend = os.environ.get("KERAS_BACKEND")
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if backend != "torch":
        raise RuntimeError(
            "keras_dtensor distributes Keras's torch backend, but "
            f"KERAS_BACKEND is {backend!r}. Set KERAS_BACKEND=torch before "
            "importing keras."
        )
    for name, installed, supported in (
        ("keras", keras_version(), SUPPORTED_KERAS),
        ("torch", torch_version(), SUPPORTED_TORCH),
    ):
        if contains(supported, installed):
            continue
        raise RuntimeError(
            f"keras_dtensor supports {name}{supported}; the installed "
            f"{name} is {installed}. Install a supported one: "
            f"pip install '{name}{supported}'."
        )


def keras_ships_torch_distribution() -> bool:
    """Whether this Keras ships its own torch distribution module.

    Keras 3.16 has `keras/src/backend/torch/distribution_lib.py` (DDP under
    `DataParallel`, a DTensor promotion mode under `ModelParallel`); 3.15
    has none.
    """
    return (
        importlib.util.find_spec("keras.src.backend.torch.distribution_lib")
        is not None
    )
