"""The DataParallel state a model carries between steps, kept on the model
(`object_state`, so `uninstall()` takes it off and removes the hooks)."""

from keras_dtensor.backend import object_state

__all__ = ["ModelState", "state_of"]

_ATTRIBUTE = "_keras_dtensor_data_parallel"


class ModelState:
    """One model's DataParallel machinery.

    Attributes:
        step: the train function the reducer and split were built for.
        reducer: its `GradientReducer`.
        split: its `UpdateSplit` of the optimizer update.
        fit_depth: how many `fit` calls of this model are running.
        statistics: its BatchNormalization moving statistics.
        probed: whether the layers adding losses were looked for.
        frozen: a rank without rows' metric states before the step.
        local_logs_warned: the step kinds warned of rank-local logs.
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
        """Removes the gradient hooks; parameters get their own storage."""
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
