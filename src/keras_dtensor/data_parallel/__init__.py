"""`DataParallel` the DDP way: plain tensors, bucketed gradient all-reduce.

Under `keras.distribution.DataParallel` every variable is replicated, so
DTensor would only add per-op dispatch cost. Instead:

- variables are ordinary torch Parameters (rank 0's values are broadcast
  once, when training starts);
- each step computes on this process's rows of the global batch
  (`batch_split`: a balanced split, sizes differ by at most one);
- gradients are all-reduced in buckets overlapped with backward
  (`reducer`), and metric states summed across ranks (`metrics`), so
  updates and logs are those of one process on the global batch;
- inside `fit`, the optimizer update is split by variable (ZeRO stage 1
  on whole variables), and stale optimizer slots are brought back when
  `fit` returns and before every save (`zero_update`); once the split
  is known to hold, gradients go to their owners only (point to point,
  ZeRO stage 2's reduce-scatter) instead of an all-reduce;
- `predict` gathers every batch's rows back into the global order;
- `BatchNormalization(synchronized=True)` normalizes with the global
  batch's statistics (`sync_batch_norm`);
- seeded random layers use this rank's rows of the global draw
  (`random_rows`);
- a layer that adds losses in its call computes them over the global
  batch (`global_batch_losses`), and a compiled loss that is no mean
  over rows is
  taken over the global batch (`global_loss`);
- the trainable parameters are stored by owner for the split update
  (`flat_params`).

The package is entered through `run_step` (`step`) and the hooks the
`PATCHES` table installs; its per-model state lives on the model (`state`).
`sync_optimizer_state(model)` is public: a save or checkpoint of a model
trained with DataParallel calls it first.
"""

from keras_dtensor.data_parallel.batch_split import split_counts
from keras_dtensor.data_parallel.global_batch_losses import call_layer
from keras_dtensor.data_parallel.global_batch_losses import wrap_add_loss
from keras_dtensor.data_parallel.metrics import wrap_compute_loss
from keras_dtensor.data_parallel.metrics import wrap_compute_loss_without_rows
from keras_dtensor.data_parallel.metrics import wrap_compute_metrics
from keras_dtensor.data_parallel.metrics import wrap_get_metrics_result
from keras_dtensor.data_parallel.random_rows import SHAPED_DRAWS
from keras_dtensor.data_parallel.random_rows import wrap_dropout
from keras_dtensor.data_parallel.random_rows import wrap_shaped_draw
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
