"""The only code that touches Keras internals: the `PATCHES` table.

Each row names one attribute of Keras (`module`, dotted `attribute`), why
it is replaced, the Keras versions it was checked against, and a factory
that builds the replacement from the original. `apply()` checks the Keras
version before touching anything, is idempotent, and tags every
replacement; `restore()` puts back only attributes that still hold our
tagged replacement (someone else's later wrapper is left alone, with a
warning), so `keras_dtensor.uninstall()` restores the originals exactly.
"""

import dataclasses
import functools
import importlib
import types
import warnings
from collections.abc import Callable
from typing import Any

from keras_dtensor import callbacks
from keras_dtensor import data
from keras_dtensor import data_parallel
from keras_dtensor import jit
from keras_dtensor import saving
from keras_dtensor import variables
from keras_dtensor.compat import SUPPORTED_KERAS

__all__ = ["PATCHES", "Patch", "apply", "is_applied", "restore", "status"]

_TAG = "__keras_dtensor_patch__"
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute of Keras.

    Attributes:
        module: module that holds the attribute (or the class holding it).
        attribute: attribute name; `Class.method` for a class attribute.
        why: what breaks without it.
        factory: `original -> replacement`; `None` original when absent.
        keras: the Keras versions this row was checked against.
    """

    module: str
    attribute: str
    why: str
    factory: Callable[[Any], Any]
    keras: str = str(SUPPORTED_KERAS)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    def owner(self):
        owner = importlib.import_module(self.module)
        *path, _ = self.attribute.split(".")
        for name in path:
            owner = getattr(owner, name)
        return owner

    @property
    def name(self) -> str:
        return self.attribute.rsplit(".", 1)[-1]


def _backend_module(original):
    from keras_dtensor import distribution_lib

    return distribution_lib


_BACKEND = "keras.src.backend"
_TORCH_CORE = "keras.src.backend.torch.core"

PATCHES = (
    Patch(
        _BACKEND,
        "distribution_lib",
        "Keras sets it to None for torch; every keras.distribution call "
        "goes through it.",
        _backend_module,
    ),
    Patch(
        "keras.src.distribution.distribution_lib",
        "distribution_lib",
        "keras.distribution binds the backend module a second time, at import.",
        _backend_module,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._initialize",
        "A variable created under a distribution must hold a DTensor laid "
        "out by Distribution.get_variable_layout, as on JAX.",
        variables.initialize,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._initialize_with_initializer",
        "The layout (and with it the process group and the agreed seed) "
        "must exist before the initializer draws the value.",
        variables.initialize_with_initializer,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._direct_assign",
        "assign/set_weights/load_weights pass global values; copy_ into a "
        "DTensor needs them laid out first.",
        variables.direct_assign,
    ),
    Patch(
        _TORCH_CORE,
        "convert_to_numpy",
        "Variable.__array__ and the optimizers convert through this "
        "binding; a DTensor must be gathered to its global value.",
        variables.convert_to_numpy,
    ),
    Patch(
        "keras.src.backend.torch",
        "convert_to_numpy",
        "Second binding of convert_to_numpy (package re-export).",
        variables.convert_to_numpy,
    ),
    Patch(
        _BACKEND,
        "convert_to_numpy",
        "Third binding: keras.ops, saving and predict call "
        "backend.convert_to_numpy.",
        variables.convert_to_numpy,
    ),
    Patch(
        "keras.src.trainers.data_adapters",
        "get_data_adapter",
        "Keras rejects every input but tf.data in multi-process runs; "
        "here every input yields the global batch and is sliced per rank.",
        data.get_data_adapter,
    ),
    Patch(
        "keras.src.backend.torch.trainer",
        "TorchEpochIterator._get_iterator",
        "Batches must enter the step as DTensors sharded along the batch "
        "axis (else: 'got mixed torch.Tensor and DTensor').",
        data.epoch_iterator,
    ),
    *(
        Patch(
            "keras.src.backend.torch.trainer",
            f"TorchTrainer.make_{kind}_function",
            f"{kind}_on_batch passes the user's arrays straight to the "
            "step; y and sample_weight must be DTensors like y_pred.",
            functools.partial(data.step_function, attribute=f"{kind}_function"),
        )
        for kind in ("train", "test", "predict")
    ),
    Patch(
        "keras.src.trainers.trainer",
        "Trainer.get_metrics_result",
        "DataParallel: each rank's metric states cover its rows; logged "
        "values must be the global ones.",
        data_parallel.metrics_result,
    ),
    *(
        Patch(
            module,
            f"{cls}._backend_update_step",
            "DataParallel: every rank applying the whole update repeats the "
            "same work; each updates the variables it owns, then they are "
            "broadcast (ZeRO stage 1 on whole variables).",
            data_parallel.split_update_step,
        )
        for module, cls in (
            ("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
            (
                "keras.src.backend.torch.optimizers.torch_parallel_optimizer",
                "TorchParallelOptimizer",
            ),
        )
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer.add_variable_from_reference",
        "A split update leaves a slot stale off its variable's owner; "
        "bringing it back needs to know its variable.",
        data_parallel.record_slot,
    ),
    Patch(
        "keras.src.backend.torch.trainer",
        "TorchTrainer.fit",
        "DataParallel splits optimizer updates only inside fit, and its "
        "end must bring the slots stale off their owner back.",
        data_parallel.split_within_fit,
    ),
    Patch(
        "keras.src.backend.torch.trainer",
        "TorchTrainer._should_torch_compile",
        "torch.compile of the whole train_step fails on DTensor tangents "
        "after the graph break at loss.backward(); compile the forward.",
        jit.should_torch_compile,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_weights_only",
        "Every rank must gather sharded weights; only rank 0 may write "
        "(h5py's lock), atomically.",
        lambda original: saving.save_collectively(original, "save_weights"),
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_model",
        "model.save: as save_weights_only.",
        lambda original: saving.save_collectively(original, "save"),
    ),
    Patch(
        "keras.src.utils.io_utils",
        "print_msg",
        "Progress bars and callback messages print once, from rank 0.",
        callbacks.print_msg,
    ),
    Patch(
        "keras.src.callbacks.callback_list",
        "CallbackList._configure_async_dispatch",
        "Batch-end callbacks on a worker thread gather DTensors out of "
        "order with the main thread's collectives: rank-divergent.",
        callbacks.configure_async_dispatch,
    ),
    Patch(
        "keras.src.layers.layer",
        "Layer.__call__",
        "Eager model(x) outside fit gets plain inputs; the outermost call "
        "lays them out like a fit batch, and tensors a layer creates are "
        "global values.",
        data.distribute_call_inputs,
    ),
    Patch(
        "keras.src.random.seed_generator",
        "SeedGenerator.next",
        "The state is a replicated DTensor under a distribution, the "
        "increment a plain tensor: mixed, wherever keras.random draws.",
        data.seed_generator_next,
    ),
)

# Saved originals: {target: (owner, had_own, original, replacement)}.
_ORIGINALS = {}


def is_applied() -> bool:
    """Whether the table is currently applied."""
    return bool(_ORIGINALS)


def _current(patch):
    return patch.owner().__dict__.get(patch.name, _MISSING)


def apply():
    """Applies every row of `PATCHES`, once.

    Raises:
        RuntimeError: the installed Keras is outside a row's range (checked
            for all rows before any attribute is replaced).
    """
    from packaging.specifiers import SpecifierSet

    from keras_dtensor.compat import keras_version

    if is_applied():
        return
    version = keras_version()
    for patch in PATCHES:
        if version not in SpecifierSet(patch.keras):
            raise RuntimeError(
                f"keras_dtensor's hook on {patch.target} was checked against "
                f"keras{patch.keras}; the installed Keras is {version}."
            )
    for patch in PATCHES:
        owner = patch.owner()
        own = patch.name in owner.__dict__
        original = getattr(owner, patch.name, None)
        replacement = patch.factory(original)
        if isinstance(replacement, types.FunctionType):
            replacement.__wrapped__ = original
            setattr(replacement, _TAG, patch.target)
        _ORIGINALS[patch.target] = (owner, own, original, replacement)
        setattr(owner, patch.name, replacement)


def restore():
    """Restores the originals of every attribute we still own."""
    for patch in reversed(PATCHES):
        entry = _ORIGINALS.pop(patch.target, None)
        if entry is None:
            continue
        owner, own, original, replacement = entry
        if owner.__dict__.get(patch.name, _MISSING) is not replacement:
            warnings.warn(
                f"{patch.target} was replaced again after keras_dtensor "
                "installed its hook; leaving the newer value in place.",
                stacklevel=3,
            )
            continue
        if own:
            setattr(owner, patch.name, original)
        else:
            delattr(owner, patch.name)


def status():
    """One row per patch: target, whether our hook is in place, why.

    Returns:
        A list of `(target, state, why)`; state is `"applied"`,
        `"original"` or `"replaced by another library"`.
    """
    rows = []
    for patch in PATCHES:
        entry = _ORIGINALS.get(patch.target)
        if entry is None:
            state = "original"
        elif _current(patch) is entry[3]:
            state = "applied"
        else:
            state = "replaced by another library"
        rows.append((patch.target, state, patch.why))
    return rows
