"""The one entry of DataParallel: Keras's own step on this process's rows.

On a new train function rank 0's weights are broadcast and the reducer
and update split built; after a step rank 0's moving statistics are
broadcast and predict outputs gathered.
"""

import functools

from keras_dtensor import compat
from keras_dtensor.backend import context
from keras_dtensor.backend.batch_layout import batch_shard
from keras_dtensor.backend.launch import world
from keras_dtensor.data_parallel import batch_split
from keras_dtensor.data_parallel import global_batch_losses
from keras_dtensor.data_parallel import metrics
from keras_dtensor.data_parallel import zero_update
from keras_dtensor.data_parallel.reducer import GradientReducer
from keras_dtensor.data_parallel.state import state_of

__all__ = [
    "run_step",
    "update_is_split",
    "wrap_distribute_tensor",
    "wrap_fit",
]


def _prepare(model, step, local):
    """The model's state for train function `step`, built once."""
    state = state_of(model)
    if state.step is step:
        return state
    from keras.layers import BatchNormalization

    zero_update.sync_optimizer_state(model)  # the owners may change
    state.close()
    zero_update.broadcast_from_rank0(model.variables)
    variables = model.trainable_weights
    state.split = zero_update.UpdateSplit(variables)
    params = [v.value for v in variables]
    state.reducer = GradientReducer(params, model, state.split.owners)
    state.statistics = [
        v
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, BatchNormalization) and layer.built
        for v in layer.non_trainable_variables
    ]
    state.step = step
    global_batch_losses.find_loss_layers(model, local)
    return state


def run_step(model, step, kind, data, distribution):
    """Runs Keras's `step` of `kind` on this process's rows of `(batch,)`;
    predict returns the global batch's outputs."""
    if world()[0] == 1:
        return step(data)  # one process: its rows are the whole batch
    (batch,) = data
    local, rows, global_rows = batch_split.local_rows(
        batch,
        distribution,
        batch_shard(batch),  # rows loaded as such
    )
    if kind == "predict":
        counts = batch_split.rank_counts(rows, global_rows)
        return batch_split.gather_rows(step([local]), counts)
    scope = global_batch_losses.step_scope(rows, global_rows)
    if kind != "train":
        with metrics.without_rows(model, rows), scope:
            return metrics.global_logs(model, kind, step([local]))
    state = _prepare(model, step, local)
    split = state.split if state.fit_depth else None
    to_owners = (
        split is not None
        and metrics.is_keras(model, "train_step")
        and split.to_owners(model.optimizer)
    )
    state.reducer.begin(rows, global_rows, to_owners=to_owners)
    try:
        with (
            batch_split.split_rows(rows, global_rows),
            zero_update.splitting_updates(split, state.reducer.to_owners),
            metrics.without_rows(model, rows),
            scope,
        ):
            logs = step([local])
        if state.statistics:  # as DDP broadcasts its buffers
            zero_update.broadcast_from_rank0(state.statistics)
        return metrics.global_logs(model, kind, logs)
    finally:
        state.reducer.active = False


def wrap_fit(original):
    """Wraps `TorchTrainer.fit`: updates split only inside, state synced."""

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        if not context.is_data_parallel():
            return original(self, *args, **kwargs)
        state = state_of(self)
        state.fit_depth += 1
        try:
            history = original(self, *args, **kwargs)
        finally:
            state.fit_depth -= 1
        zero_update.sync_optimizer_state(self)
        return history

    return fit


def update_is_split(model):
    """Whether `model`'s DataParallel training splits its optimizer update
    (`None` before it trained on several processes)."""
    state = state_of(model, create=False)
    if state is None or state.split is None:
        return None
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return bool(state.split.checked.get(optimizer, False))


def wrap_distribute_tensor(original):
    """Wraps `distribute_tensor`: plain under `DataParallel`, as variables."""

    @functools.wraps(original)
    def distribute_tensor(tensor, layout):
        if context.is_data_parallel():
            return compat.torch_core().convert_to_tensor(tensor)
        return original(tensor, layout)

    return distribute_tensor
