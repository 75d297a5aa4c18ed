"""Version gates for Keras and torch, and detection of upstream support."""

import importlib.util
import os

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "SUPPORTED_KERAS",
    "SUPPORTED_TORCH",
    "check_environment",
    "keras_version",
    "torch_version",
    "upstream_torch_distribution_lib",
]

SUPPORTED_KERAS = SpecifierSet(">=3.15,<3.16")
# Tested: 2.11 (CUDA), 2.13 (CI), 2.14 (the suite on CPU). A newer torch
# fails at install() with this range in the message; widen it after the
# suite passes on the new version.
SUPPORTED_TORCH = SpecifierSet(">=2.11,<2.15")


def keras_version() -> Version:
    """The installed Keras version, without importing Keras."""
    from importlib.metadata import version

    return Version(version("keras"))


def torch_version() -> Version:
    """The installed torch version, without its local part (`+cpu`)."""
    import torch

    return Version(torch.__version__.split("+")[0])


def check_environment():
    """Raises a clear error unless Keras and torch are supported.

    Raises:
        RuntimeError: the Keras backend is not torch, or the Keras or torch
            version is outside the tested range.
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
    version = keras_version()
    if version not in SUPPORTED_KERAS:
        raise RuntimeError(
            f"keras_dtensor supports keras{SUPPORTED_KERAS}; the installed "
            f"Keras is {version}. Install a supported Keras "
            "(pip install 'keras==3.15.1')."
        )
    if torch_version() not in SUPPORTED_TORCH:
        raise RuntimeError(
            f"keras_dtensor supports torch{SUPPORTED_TORCH}; the installed "
            f"torch is {torch_version()}."
        )


def upstream_torch_distribution_lib() -> bool:
    """Whether this Keras ships its own (partial) torch distribution module.

    Keras master has `keras/src/backend/torch/distribution_lib.py`
    (DataParallel through DDP only); no release up to 3.15.1 does.
    """
    return (
        importlib.util.find_spec("keras.src.backend.torch.distribution_lib")
        is not None
    )
