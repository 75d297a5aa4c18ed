"""The supported Keras and torch releases, and where Keras keeps what we hook.

Nothing else tests a version. `check_environment()` refuses, at import, an
unsupported Keras or torch with the pip command that fixes it; `KERAS` maps
each Keras name we use to its place on the installed release.
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
    "keras_ships_torch_distribution",
    "keras_version",
    "torch_core",
    "torch_trainer_class",
    "torch_version",
]

# Keep in step with pyproject.toml and the README (keras-nightly inside).
SUPPORTED_KERAS = SpecifierSet(">=3.15,<3.17")
SUPPORTED_TORCH = SpecifierSet(">=2.11,<2.16")

# The ranges of one release line.
KERAS_3_15 = ">=3.15,<3.16.0.dev0"
KERAS_3_16 = ">=3.16.0.dev0,<3.17"


def contains(spec, version) -> bool:
    """`version in spec`, pre-releases included (keras-nightly: 3.16.0.devN)."""
    return SpecifierSet(str(spec)).contains(version, prereleases=True)


@functools.cache
def keras_version() -> Version:
    """The version of the Keras `import keras` loads (`keras` and
    `keras-nightly` share the folder), read without importing it."""
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
    installed = _installed("keras", "keras-nightly")
    if installed is None:
        raise RuntimeError(
            f"keras_dtensor needs Keras: pip install 'keras{SUPPORTED_KERAS}'."
        )
    return installed


def _installed(*names):
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    for name in names:
        try:
            return Version(version(name))
        except PackageNotFoundError:
            continue
    return None


def torch_version() -> Version:
    """The installed torch version, without its local part (`+cpu`)."""
    import torch

    return Version(torch.__version__.split("+")[0])


def keras_hub_version():
    """The installed keras_hub version, or `None`."""
    return _installed("keras-hub", "keras-hub-nightly")


_NEW = keras_version() >= Version("3.16.0.dev0")  # the 3.16 layout
_OPS = "keras.src.backend.torch.ops" if _NEW else "keras.src.backend.torch"
KERAS = types.SimpleNamespace(
    torch_core=f"{_OPS}.core",
    torch_numpy=f"{_OPS}.numpy",
    torch_nn=f"{_OPS}.nn",
    torch_ops=_OPS,  # re-exports core's functions
    torch_trainer="Trainer" if _NEW else "TorchTrainer",
    should_compile="_use_torch_compile" if _NEW else "_should_torch_compile",
    base_trainer="BaseTrainer" if _NEW else "Trainer",
)


def torch_core():
    """Keras's torch backend `core` module (`Variable`, `convert_to_tensor`)."""
    return importlib.import_module(KERAS.torch_core)


def torch_trainer_class():
    """Keras's torch trainer class (`TorchTrainer`, `Trainer` on 3.16)."""
    module = importlib.import_module("keras.src.backend.torch.trainer")
    return getattr(module, KERAS.torch_trainer)


def base_trainer_class():
    """Keras's backend-agnostic trainer (`Trainer`, `BaseTrainer` on 3.16)."""
    module = importlib.import_module("keras.src.trainers.trainer")
    return getattr(module, KERAS.base_trainer)


def data_adapter_class(name):
    """One of Keras's data adapter classes, by name (`PyDatasetAdapter`)."""
    module = importlib.import_module("keras.src.trainers.data_adapters")
    return getattr(module, name)


def check_environment():
    """`RuntimeError` unless the backend is torch and Keras and torch are
    supported."""
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
    """Whether this Keras ships its own torch distribution (3.16 does)."""
    return (
        importlib.util.find_spec("keras.src.backend.torch.distribution_lib")
        is not None
    )
