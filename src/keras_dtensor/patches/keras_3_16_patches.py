"""The entries that stand down Keras 3.16's own torch distribution.

Keras 3.16 ships a torch distribution of its own; where keras-dtensor does
the same job, the upstream piece steps aside while installed, so nothing is
done twice (`hooks/keras_torch_distribution.py` says why for each). Every
entry here declares `keras>=3.16`: on Keras 3.15 they are skipped.
"""

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
        "Keras 3.16 wraps the model in DDP whenever a process group is up; "
        "keras-dtensor reduces DataParallel's gradients itself: with both, "
        "they would be reduced twice.",
        upstream.wrap_initialize_ddp,
        keras=KERAS_3_16,
    ),
    Patch(
        _TRAINER,
        "Trainer.get_metrics_result",
        "Keras 3.16 sums every metric variable across processes here; "
        "keras-dtensor's metrics are global values already: summed twice.",
        upstream.wrap_get_metrics_result,
        keras=KERAS_3_16,
    ),
    Patch(
        _TRAINER,
        "_distribute_data",
        "train_on_batch/test_on_batch/predict_on_batch: Keras 3.16 takes "
        "each process's arrays as its shard (DTensor.from_local), N times "
        "the global batch; they stay the global batch.",
        upstream.wrap_distribute_data,
        keras=KERAS_3_16,
    ),
    Patch(
        _TRAINER,
        "_gather_non_batch_axes",
        "Keras 3.16's predict keeps each process's entries of a DTensor "
        "output; predictions are global values on every process.",
        upstream.wrap_gather_non_batch_axes,
        keras=KERAS_3_16,
    ),
    Patch(
        KERAS.torch_core,
        "Variable._initialize_distributed",
        "Keras 3.16 lays variables out itself; the hooks above do (sharded "
        "initialization, checked layouts): its own path lays out none.",
        upstream.wrap_initialize_distributed,
        keras=KERAS_3_16,
    ),
)
