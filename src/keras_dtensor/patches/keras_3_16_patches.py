"""The entries that stand down Keras 3.16's own torch distribution where
keras-dtensor does the same job (`hooks.keras_torch_distribution`)."""

import functools

from keras_dtensor.compat import KERAS
from keras_dtensor.compat import KERAS_3_16
from keras_dtensor.hooks import keras_torch_distribution as upstream
from keras_dtensor.patches.patch_kinds import Patch

__all__ = ["KERAS_3_16_PATCHES"]

_TRAINER = "keras.src.backend.torch.trainer"
_patch = functools.partial(Patch, keras=KERAS_3_16)  # every entry here
KERAS_3_16_PATCHES = (
    _patch(
        _TRAINER,
        "Trainer._initialize_ddp",
        "Keras 3.16's DDP wrapper would reduce gradients a second time.",
        upstream.wrap_initialize_ddp,
    ),
    _patch(
        _TRAINER,
        "Trainer.get_metrics_result",
        "Keras 3.16 would sum the already global metric values again.",
        upstream.wrap_get_metrics_result,
    ),
    _patch(
        _TRAINER,
        "_distribute_data",
        "*_on_batch: Keras 3.16 would take each process's arrays as a shard.",
        upstream.wrap_distribute_data,
    ),
    _patch(
        _TRAINER,
        "_gather_non_batch_axes",
        "Predictions are global values; Keras 3.16 keeps each process's.",
        upstream.wrap_gather_non_batch_axes,
    ),
    _patch(
        KERAS.torch_core,
        "Variable._initialize_distributed",
        "keras-dtensor's hooks lay variables out, not Keras 3.16's own.",
        upstream.wrap_initialize_distributed,
    ),
)
