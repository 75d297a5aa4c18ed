"""The DataParallel state a model carries between steps.

Kept on the model itself (through `object_state`, so `uninstall()`
takes it off and removes the gradient hooks): no module-level state.
"""

from keras_dtensor.backend import object_state

__all__ = ["ModelState", "state_of"]

_ATTRIBUTE = "_keras_dtensor_data_parallel"


class ModelState:
    """One model's DataParallel machinery.

    Attributes:
        step: the train function the reducer and split were built for.
        reducer: its `GradientReducer` (`None` at world size 1).
        split: its `UpdateSplit` of the optimizer update.
        fit_depth: how many `fit` calls of this model are running.
        statistics: the moving statistics of its BatchNormalization
            layers, kept equal to rank 0's after every train step.
        probed: whether the layers adding losses were looked for, for
            this train function (`global_batch_losses.find_loss_layers`).
        frozen: during a step of a rank with no rows, its metric states
            as they were before the step (`metrics.without_rows`).
        local_logs_warned: the step kinds (`"train"`, `"test"`) whose
            custom step was found to log values of its own rank.
    """

    def __init__(self):
        self.step = None
        self.reducer = None
        self.split = None
        self.fit_depth = 0
        self.statistics = []
        self.frozen = None
        self.probed = False
        self.local_logs_warned = set()

    def close(self):
        """Removes the reducer's gradient hooks and gives the parameters
        their own storage back (`flat_params`)."""
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self.split is not None and self.split.buffers is not None:
            self.split.buffers.release()
            self.split.buffers = None


def state_of(model, create=True):
    """The model's `ModelState` (made on first use when `create`)."""
    state = object_state.get_on(model, _ATTRIBUTE)
    if state is None and create:
        state = object_state.set_on(
            model, _ATTRIBUTE, ModelState(), undo=ModelState.close
        )
    return state
