"""The DataParallel state a model carries between steps (`object_state`)."""

from keras_dtensor.backend import object_state

__all__ = ["ModelState", "state_of"]

_ATTRIBUTE = "_keras_dtensor_data_parallel"


class ModelState:
    """One model's DataParallel machinery."""

    def __init__(self):
        self.step = None  # the train function the rest was built for
        self.reducer = None  # its `GradientReducer`
        self.split = None  # its `UpdateSplit`
        self.fit_depth = 0  # how many `fit` calls of the model run
        self.statistics = []  # BatchNormalization moving statistics
        self.frozen = None  # a rank without rows' metric states
        self.local_logs_warned = set()  # step kinds warned of local logs

    def close(self):
        """Removes the gradient hooks; parameters get their own storage."""
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self.split is not None:
            self.split.release()


def state_of(model, create=True):
    """The model's `ModelState` (made on first use when `create`)."""
    state = object_state.get_on(model, _ATTRIBUTE)
    if state is None and create:
        state = object_state.set_on(
            model, _ATTRIBUTE, ModelState(), undo=ModelState.close
        )
    return state
