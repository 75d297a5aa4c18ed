"""The entries that stand down Keras 3.16's own torch distribution where
keras-dtensor does the same job (`hooks.keras_torch_distribution`)."""

from keras_dtensor.compat import KERAS
from keras_dtensor.compat import KERAS_3_16
from keras_dtensor.hooks import keras_torch_distribution as upstream
from keras_dtensor.patches.patch_kinds import Patch

__all__ = ["KERAS_3_16_PATCHES"]

_TRAINER = "keras.src.backend.torch.trainer"
KERAS_3_16_PATCHES = (
    Patch(
        _TRAINER,
        "Trainer._initialize_ddp",
        "Keras 3.16 wraps the model in DDP whenever a process group is "
        "up: gradients would be reduced twice.",
        upstream.wrap_initialize_ddp,
        keras=KERAS_3_16,
    ),
    Patch(
        _TRAINER,
        "Trainer.get_metrics_result",
        "Keras 3.16 sums metric variables across processes: the global "
        "values would be summed twice.",
        upstream.wrap_get_metrics_result,
        keras=KERAS_3_16,
    ),
    Patch(
        _TRAINER,
        "_distribute_data",
        "*_on_batch: Keras 3.16 takes each process's arrays as its shard, "
        "N times the global batch.",
        upstream.wrap_distribute_data,
        keras=KERAS_3_16,
    ),
    Patch(
        _TRAINER,
        "_gather_non_batch_axes",
        "Keras 3.16's predict keeps each process's entries; predictions "
        "are global values.",
        upstream.wrap_gather_non_batch_axes,
        keras=KERAS_3_16,
    ),
    Patch(
        KERAS.torch_core,
        "Variable._initialize_distributed",
        "Keras 3.16 lays variables out itself; keras-dtensor's hooks do "
        "(sharded initialization, checked layouts).",
        upstream.wrap_initialize_distributed,
        keras=KERAS_3_16,
    ),
)
