"""Metric reduction of a DataParallel step: every log is the global one.

States set before backward ride in the reducer's last bucket
(`EarlyMetrics`), later ones take one all-reduce when Keras reads results.
"""

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist

from keras_dtensor import compat
from keras_dtensor.backend import console
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.data_parallel import global_batch_losses
from keras_dtensor.data_parallel.state import state_of
from keras_dtensor.ops.flat_buffers import offsets

__all__ = [
    "EarlyMetrics",
    "global_logs",
    "without_rows",
    "is_keras",
    "wrap_compute_loss",
    "wrap_compute_loss_without_rows",
    "wrap_compute_metrics",
    "wrap_get_metrics_result",
]


class EarlyMetrics:
    """`states` (one order on every rank) summed in the last bucket's tail
    or alone (`launch()`); `frozen`: `{id(state): value}` summed instead."""

    def __init__(self, states, frozen=None):
        self.states = states
        self.versions = [s._version for s in states]
        values = [(frozen or {}).get(id(s), s) for s in states]
        self.flat = torch.cat([v.detach().reshape(-1).double() for v in values])
        self.work = None
        self.pending = True  # neither launched nor received

    @staticmethod
    def states_of(model, with_compiled):
        """The loss tracker's states; with `with_compiled`, every metric's."""
        tracker = getattr(model, "_loss_tracker", None)
        if tracker is None:
            return []
        states = [v.value for v in tracker.variables]
        if with_compiled:
            states += [
                v.value
                for metric in model.metrics
                if metric is not tracker
                for v in metric.variables
            ]
        return states

    def launch(self):
        """All-reduces the states on their own."""
        self.pending = False
        self.work = dist.all_reduce(self.flat, async_op=True)

    def received(self, flat):
        """Takes the sum carried by a gradient bucket."""
        self.pending = False
        self.flat = flat

    def unchanged(self):
        """Whether each state is as it was summed (same `_version`)."""
        return [
            s._version == version
            for s, version in zip(self.states, self.versions, strict=True)
        ]

    def summed(self):
        """`{id(state): summed value}` for the states unchanged since."""
        if self.pending:  # the step ended before any bucket ran
            self.launch()
        if self.work is not None:
            self.work.wait()
            self.work = None
        places = offsets([s.shape for s in self.states])
        pairs = zip(self.states, places, self.unchanged(), strict=True)
        return {
            id(s): self.flat[start : start + n].view_as(s).to(s.dtype)
            for s, (start, n), same in pairs
            if same
        }


@contextlib.contextmanager
def without_rows(model, rows):
    """A rank with no rows leaves its metric states as before the step."""
    if rows:
        yield
        return
    state = state_of(model)
    states = [v.value for m in model.metrics for v in m.variables]
    state.frozen = {id(s): s.detach().clone() for s in states}
    try:
        yield
    finally:
        early = getattr(state.reducer, "early", None)
        unchanged = None if early is None else early.unchanged()
        with torch.no_grad():
            for s in states:
                s.copy_(state.frozen[id(s)])
        if early is not None:
            # The early sum took the frozen values: current where unwritten.
            early.versions = [
                s._version if same else version
                for s, version, same in zip(
                    early.states, early.versions, unchanged, strict=True
                )
            ]
        state.frozen = None


def wrap_get_metrics_result(original):
    """Wraps `Trainer.get_metrics_result`: results of the summed states."""

    def get_metrics_result(self):
        distribution = context.active()
        if distribution is None or not context.is_data_parallel(distribution):
            return original(self)
        metrics = list(self.metrics)
        states = [[v.value for v in m.variables] for m in metrics]
        flat_states = [s for group in states for s in group]
        # Keras's symbolic build: meta tensors, nothing to sum (torch's
        # meta all-reduce would draw from Python's `random`).
        if not flat_states or any(s.is_meta for s in flat_states):
            return original(self)
        state = state_of(self, create=False)
        early = getattr(getattr(state, "reducer", None), "early", None)
        summed = {} if early is None else early.summed()
        late = [s for s in flat_states if id(s) not in summed]
        if late:
            frozen = getattr(state, "frozen", None)
            summed.update(EarlyMetrics(late, frozen).summed())
        results = {}
        for metric, group in zip(metrics, states, strict=True):
            result = metric.stateless_result([summed[id(s)] for s in group])
            if isinstance(result, dict):
                results.update(result)
            else:
                results[metric.name] = result
        return results

    return get_metrics_result


@functools.cache
def _torch_trainer():
    return compat.torch_trainer_class()


def is_keras(model, name):
    """Whether `model`'s method `name` is Keras's own."""
    return getattr(type(model), name) is getattr(_torch_trainer(), name)


def global_logs(model, kind, logs):
    """A train or test step's logs, global: in a custom step's, a metric
    result's key gets the global result, others warn once and stay local."""
    name = f"{kind}_step"
    if is_keras(model, name) or not isinstance(logs, dict):
        return logs
    results = model.get_metrics_result()
    local = []

    def rebuild(values):
        out = {}
        for key, value in values.items():
            if isinstance(value, dict):
                out[key] = rebuild(value)
            elif key in results:
                out[key] = results[key]
            else:
                out[key] = value
                local.append(key)
        return out

    out = rebuild(logs)
    if not local:
        return out
    state = state_of(model)
    if kind not in state.local_logs_warned:
        state.local_logs_warned.add(kind)
        if not console.silent():
            warnings.warn(
                f"DataParallel: the custom {name} of model "
                f"'{model.name}' returns {sorted(local)}, which are not "
                "results of the model's metrics (`model.metrics`): each "
                "process reports its own value, computed from its rows "
                "of the batch. Update a `keras.metrics` metric in the "
                "step and return its `result()` to log the global value.",
                stacklevel=2,
            )
    return out


def _armed_reducer(model):
    """The reducer in a train step of Keras's own methods, else `None`."""
    if context.current() is None:  # before any lookup torch.compile guards
        return None
    reducer = getattr(state_of(model, create=False), "reducer", None)
    if reducer is None or not reducer.active:
        return None
    keras_own = is_keras(model, "train_step")
    return reducer if keras_own and is_keras(model, "compute_metrics") else None


def wrap_compute_loss(original):
    """Wraps `Trainer._compute_loss`: compiled metrics updated right after."""

    @functools.wraps(original)
    def _compute_loss(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        if args or not kwargs.get("training", True):
            return loss
        reducer = _armed_reducer(self)
        if reducer is None or self._compile_metrics is None:
            return loss
        with torch.no_grad():
            self._compile_metrics.update_state(
                kwargs.get("y"),
                kwargs.get("y_pred"),
                kwargs.get("sample_weight"),
            )
        reducer.metrics_updated = True
        return loss

    return _compute_loss


def wrap_compute_loss_without_rows(original):
    """Wraps `Trainer.compute_loss`: global-batch losses; a rank with no
    rows gets a scalar zero loss, so backward runs as on the others."""

    @functools.wraps(original)
    def compute_loss(self, *args, **kwargs):
        distribution = context.active()
        if distribution is None or not context.is_data_parallel(distribution):
            return original(self, *args, **kwargs)
        step = global_batch_losses.current_step()
        if step is None:
            # compute_loss(x, y, y_pred, ...): Keras passes them by position.
            given = dict(zip(("x", "y", "y_pred"), args, strict=False))
            given.update(kwargs)
            y_pred = given.get("y_pred")
            if isinstance(y_pred, torch.Tensor) and y_pred.is_meta:
                loss = original(self, *args, **kwargs)  # builds the losses
                global_batch_losses.probe(self, given.get("y"), y_pred)
                return loss
        elif global_batch_losses.needs_global(self):
            loss = global_batch_losses.over_global_batch(
                self._compile_loss, step
            )
            with object_state.swapped(self, "_compile_loss", loss):
                return original(self, *args, **kwargs)
        if getattr(state_of(self, create=False), "frozen", None) is None:
            return original(self, *args, **kwargs)
        compiled = self.__dict__.get("_compile_loss")
        # Keras stacks it with the losses layers added: a scalar first.
        swap = contextlib.nullcontext()
        if compiled is not None:
            swap = object_state.swapped(
                self,
                "_compile_loss",
                lambda *a, **k: _summed_if_empty(compiled(*a, **k)),
            )
        with swap:
            return _summed_if_empty(original(self, *args, **kwargs))

    return compute_loss


def _summed_if_empty(loss):
    if isinstance(loss, torch.Tensor) and loss.ndim and loss.numel() == 0:
        return loss.sum()
    return loss


def wrap_compute_metrics(original):
    """Wraps `Trainer.compute_metrics`: no second update after
    `wrap_compute_loss`'s."""

    @functools.wraps(original)
    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        reducer = _armed_reducer(self)
        if reducer is not None and reducer.metrics_updated:
            reducer.metrics_updated = False
            return self.get_metrics_result()
        return original(self, x, y, y_pred, sample_weight)

    return compute_metrics
