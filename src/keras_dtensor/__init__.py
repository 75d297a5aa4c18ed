"""keras-dtensor: Keras 3's distribution API on the torch backend, via DTensor.

`import keras_dtensor` installs it into Keras (setting
`KERAS_BACKEND=torch` if unset); `keras.distribution` then works as on
JAX, in a script run under `torchrun` (README.md). The parts, lowest
first: `config`, `compat`; `backend`; `ops`; `data_parallel`,
`model_parallel`, `planning`; `saving`, `checkpoint`; `hooks`, `patches`;
`cli`, `demo` (docs/internals/architecture.md).
"""

import os
import sys
import warnings

__version__ = "0.1.0"
__all__ = [
    "PREEMPTED_EXIT_CODE",
    "ShardedCheckpoint",
    "auto_layout",
    "auto_layout_map",
    "__version__",
    "install",
    "is_installed",
    "latest_checkpoint",
    "load_checkpoint",
    "plan",
    "save_checkpoint",
    "uninstall",
]

if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "torch")


def install() -> None:
    """Installs the torch distribution backend into Keras (on import; a
    second call warns and does nothing).

    Raises:
        RuntimeError: the backend is not torch, or a version unsupported.

    Example:
    >>> keras_dtensor.uninstall(); keras_dtensor.install()
    """
    from keras_dtensor import compat
    from keras_dtensor import config
    from keras_dtensor import patches

    compat.check_environment()
    config.check()
    if patches.is_applied():
        warnings.warn(
            "keras_dtensor is already installed; nothing to do.", stacklevel=2
        )
        return
    patches.apply()
    if compat.keras_ships_torch_distribution():
        import logging

        logging.getLogger("keras_dtensor").info(
            "Keras %s ships a torch distribution of its own; keras_dtensor "
            "replaces its distribution_lib, DDP wrapping, metric summing, "
            "variable and batch layouts and sharded attention while "
            "installed (`keras-dtensor info` lists each; uninstall() puts "
            "them back).",
            compat.keras_version(),
        )


def uninstall() -> None:
    """Restores everything keras_dtensor replaced in Keras and torch.

    Example:
    >>> keras_dtensor.uninstall()
    >>> keras_dtensor.is_installed()
    False
    """
    from keras_dtensor import patches
    from keras_dtensor.backend import context

    patches.restore()
    context.set_global_values(None)


def is_installed() -> bool:
    """Whether keras_dtensor's hooks are in place: between `install()`
    (run on import) and `uninstall()`.

    Example:
    >>> keras_dtensor.is_installed()
    True
    """
    from keras_dtensor import patches

    return patches.is_applied()


install()


_LAZY = {
    "save_checkpoint": "keras_dtensor.checkpoint",
    "load_checkpoint": "keras_dtensor.checkpoint",
    "latest_checkpoint": "keras_dtensor.checkpoint",
    "ShardedCheckpoint": "keras_dtensor.checkpoint",
    "PREEMPTED_EXIT_CODE": "keras_dtensor.checkpoint",
    "auto_layout": "keras_dtensor.planning",
    "auto_layout_map": "keras_dtensor.planning",
    "plan": "keras_dtensor.planning",
}


def __getattr__(name):
    # Imported on first use: `import keras_dtensor` stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'keras_dtensor' has no attribute {name!r}")
