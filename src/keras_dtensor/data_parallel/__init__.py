"""`DataParallel` the DDP way: plain tensors, bucketed gradient all-reduce.

Every variable is replicated, so DTensor would only add dispatch cost.
`step` runs Keras's own step on this process's rows (`batch_split`);
gradients and metric states are reduced with backward (`reducer`,
`metrics`); inside `fit` the update is split (`zero_update`); batch
statistics (`sync_batch_norm`) and losses that are no mean over rows
(`global_batch_losses`) are the global batch's; per-model `state`.
Design: `docs/internals/data-parallel.md`.
"""

from keras_dtensor.data_parallel.batch_split import SHAPED_DRAWS
from keras_dtensor.data_parallel.batch_split import split_counts
from keras_dtensor.data_parallel.batch_split import wrap_dropout
from keras_dtensor.data_parallel.batch_split import wrap_shaped_draw
from keras_dtensor.data_parallel.global_batch_losses import call_layer
from keras_dtensor.data_parallel.global_batch_losses import wrap_add_loss
from keras_dtensor.data_parallel.metrics import wrap_compute_loss
from keras_dtensor.data_parallel.metrics import wrap_compute_loss_without_rows
from keras_dtensor.data_parallel.metrics import wrap_compute_metrics
from keras_dtensor.data_parallel.metrics import wrap_get_metrics_result
from keras_dtensor.data_parallel.step import run_step
from keras_dtensor.data_parallel.step import update_is_split
from keras_dtensor.data_parallel.step import wrap_distribute_tensor
from keras_dtensor.data_parallel.step import wrap_fit
from keras_dtensor.data_parallel.sync_batch_norm import wrap_batch_norm_init
from keras_dtensor.data_parallel.sync_batch_norm import wrap_moments
from keras_dtensor.data_parallel.zero_update import has_stale_state
from keras_dtensor.data_parallel.zero_update import sync_optimizer_state
from keras_dtensor.data_parallel.zero_update import (
    wrap_add_variable_from_reference,
)
from keras_dtensor.data_parallel.zero_update import wrap_backend_update_step

__all__ = [
    "SHAPED_DRAWS",
    "call_layer",
    "has_stale_state",
    "run_step",
    "split_counts",
    "sync_optimizer_state",
    "update_is_split",
    "wrap_add_loss",
    "wrap_add_variable_from_reference",
    "wrap_backend_update_step",
    "wrap_batch_norm_init",
    "wrap_compute_loss",
    "wrap_compute_loss_without_rows",
    "wrap_compute_metrics",
    "wrap_distribute_tensor",
    "wrap_dropout",
    "wrap_fit",
    "wrap_get_metrics_result",
    "wrap_moments",
    "wrap_shaped_draw",
]
