"""Losses that are no mean over rows, computed over the global batch.

In a train step a layer that adds losses runs on DTensors over the batch
mesh (`call_layer`; on the gathered batch where the split is uneven), and
a compiled loss that is no mean over rows on the gathered batch
(`over_global_batch`), as on JAX. Design: `docs/internals/data-parallel.md`.
"""

import contextlib
import functools
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import implicit_replication

from keras_dtensor import compat
from keras_dtensor.backend import console
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import world
from keras_dtensor.backend.shards import from_local
from keras_dtensor.data_parallel.batch_split import gather_rows
from keras_dtensor.data_parallel.batch_split import rank_counts

__all__ = [
    "call_layer",
    "current_step",
    "find_loss_layers",
    "needs_global",
    "over_global_batch",
    "probe",
    "step_scope",
    "wrap_add_loss",
]

_ADDS_LOSSES = "_keras_dtensor_adds_losses"
# A layer whose DTensor run failed: it runs on the gathered global batch.
_GATHERED = "_keras_dtensor_adds_losses_gathered"
_STEP = "keras_dtensor_data_parallel_step"
_GLOBAL = ("sum", "mean_with_sample_weight")
_WHOLE_BATCH = "_keras_dtensor_whole_batch_loss"


class _Step:
    """The running train step: this rank's rows and the global batch's."""

    def __init__(self, rows, global_rows):
        self.rows = rows
        self.global_rows = global_rows
        self.counts = None
        self.inside = False  # a layer of the step runs over the batch

    def count(self):
        """`(every rank's rows, this rank's share)`, counted once."""
        if self.counts is None:
            self.counts = rank_counts(self.rows, self.global_rows)
            self.global_rows = sum(self.counts)
        return self.counts, self.rows / self.global_rows


class _Rows(torch.autograd.Function):
    """This rank's rows to the global batch (`gather`) or back; backward
    the reverse, this rank's rows of the gradient multiplied by `scale`."""

    @staticmethod
    def forward(ctx, x, counts, gather, scale):
        ctx.counts, ctx.gather, ctx.scale = counts, gather, scale
        if gather:
            return gather_rows(x.detach().contiguous(), counts)
        return _own_rows(x.detach(), counts).clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.gather:  # the product is the new tensor: no copy first
            grad = _own_rows(grad, ctx.counts) * ctx.scale
        else:
            grad = gather_rows((grad * ctx.scale).contiguous(), ctx.counts)
        return grad, None, None, None


def _own_rows(x, counts):
    """This rank's rows of global batch `x`, a view."""
    rank = world()[1]
    start = sum(counts[:rank])
    return x[start : start + counts[rank]]


def _scaled(x, scale):
    """`x`; backward multiplies its gradient by `scale`."""
    if not x.requires_grad:
        return x
    x = x.view_as(x)
    x.register_hook(lambda grad: grad * scale)
    return x


def _global_state():
    from keras.src.backend.common import global_state

    return global_state


@contextlib.contextmanager
def step_scope(rows, global_rows):
    """Marks a DataParallel train step on this rank's `rows` of a global
    batch of `global_rows` (`None`: counted when needed)."""
    state = _global_state()
    previous = state.get_global_attribute(_STEP)
    state.set_global_attribute(_STEP, _Step(rows, global_rows))
    try:
        yield
    finally:
        state.set_global_attribute(_STEP, previous)


def _to_local(x):
    """A DTensor loss as a plain tensor: the global value."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def wrap_add_loss(original):
    """Wraps `Layer.add_loss`: marks the layer; a DTensor loss made global."""

    @functools.wraps(original)
    def add_loss(self, loss):
        if not object_state.get_on(self, _ADDS_LOSSES):
            object_state.set_on(self, _ADDS_LOSSES, True)
        step = current_step()
        if step is None or not step.inside:  # DTensors are ours only there
            return original(self, loss)
        if isinstance(loss, (list, tuple)):
            loss = type(loss)(_to_local(x) for x in loss)
        return original(self, _to_local(loss))

    return add_loss


def find_loss_layers(model, batch):
    """Marks `model`'s layers that add losses, by a symbolic training call."""
    from keras.src import backend
    from keras.src import tree
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
    spec = tree.map_structure(
        lambda t: (
            backend.KerasTensor(tuple(t.shape), dtype=t.dtype)
            if isinstance(t, torch.Tensor)
            else t
        ),
        x,
    )
    with contextlib.suppress(Exception):  # one Keras cannot trace: as is
        backend.compute_output_spec(model, spec, training=True)


def current_step():
    """The running DataParallel step (`step_scope`), or None."""
    return _global_state().get_global_attribute(_STEP)


def _gather(x, step, counts, share, with_grad=True, mask=False):
    """This rank's rows `x` as the global batch; gradient divided by `share`."""
    from keras.src.backend.common.masking import get_keras_mask
    from keras.src.backend.common.masking import set_keras_mask

    if not _batch_aligned(x, step):
        return x
    keras_mask = get_keras_mask(x) if mask else None
    if with_grad and x.requires_grad:
        out = _Rows.apply(x, counts, True, 1.0 / share if share else 1.0)
    else:
        out = gather_rows(x.detach(), counts)
    if keras_mask is not None:
        set_keras_mask(out, gather_rows(keras_mask, counts))
    return out


def call_layer(layer, original, args, kwargs):
    """`layer(*args, **kwargs)` in a DataParallel step: over the global
    batch if the layer adds losses and a train step runs, else as is."""
    step = current_step() if object_state.get_on(layer, _ADDS_LOSSES) else None
    if (
        step is None
        or step.inside
        or not torch.is_grad_enabled()
        or torch.compiler.is_compiling()
    ):
        return original(layer, *args, **kwargs)
    step.inside = True
    try:
        return _on_global_batch(layer, original, args, kwargs, step)
    finally:
        step.inside = False


def _on_global_batch(layer, original, args, kwargs, step):
    counts, share = step.count()
    if step.global_rows % world()[0] == 0 and not object_state.get_on(
        layer, _GATHERED
    ):
        try:
            return _as_dtensors(layer, original, args, kwargs, step, share)
        except RuntimeError as e:
            if "propagation" not in str(e) and "DTensor" not in str(e):
                raise
            object_state.set_on(layer, _GATHERED, True)
            if not console.silent():
                warnings.warn(
                    f"DataParallel: layer '{layer.name}' adds losses and "
                    "could not run as DTensors over the batch "
                    f"({' '.join(str(e).split())[:200]}); it now runs on "
                    "the whole global batch on every rank (the same "
                    "results, more compute).",
                    stacklevel=4,
                )
    return _gathered(layer, original, args, kwargs, step, counts, share)


def _plain(x):
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def _batch_aligned(x, step):
    return _plain(x) and x.shape[:1] == (step.rows,)


def _gathered(layer, original, args, kwargs, step, counts, share):
    """The layer on the gathered batch; this rank keeps its output rows."""
    from keras.src import tree

    args, kwargs = tree.map_structure(
        lambda x: _gather(x, step, counts, share), (args, kwargs)
    )
    outputs = original(layer, *args, **kwargs)

    def own(x):
        if isinstance(x, torch.Tensor) and x.shape[:1] == (step.global_rows,):
            return _Rows.apply(x, counts, False, share)
        return x

    return tree.map_structure(own, outputs)


def _as_dtensors(layer, original, args, kwargs, step, share):
    """The layer on DTensors: rows sharded, trainable weights replicated."""
    from keras.src import tree

    mesh = context.current().device_mesh.backend_mesh

    def shard(x):
        if not _batch_aligned(x, step):
            return x
        if share:
            x = _scaled(x, 1.0 / share)
        shape = (step.global_rows, *x.shape[1:])
        return from_local(x, mesh, [Shard(0)], shape)

    args, kwargs = tree.map_structure(shard, (args, kwargs))
    with contextlib.ExitStack() as stack:
        for variable in layer.trainable_variables:
            value = variable._value
            if _plain(value):
                value = DTensor.from_local(value, mesh, [Replicate()])
                stack.enter_context(
                    object_state.swapped(variable, "_value", value)
                )
        stack.enter_context(implicit_replication())
        outputs = original(layer, *args, **kwargs)

    def local(x):
        if not isinstance(x, DTensor):
            return x
        if x.placements[0] == Shard(0):
            return _scaled(x.to_local(), share)
        return x.full_tensor()

    return tree.map_structure(local, outputs)


def needs_global(model):
    """Whether `model` compiled a loss that is no mean over rows."""
    return any(
        getattr(loss_fn, "reduction", None) in _GLOBAL
        or object_state.get_on(loss_fn, _WHOLE_BATCH)
        for loss_fn in _flat_losses(model)
    )


def probe(model, y_true, y_pred):
    """Notes which non-Keras losses return one value for the whole batch."""
    from keras.src import tree

    if tree.is_nested(y_true) or tree.is_nested(y_pred):
        return
    for loss_fn in _flat_losses(model):
        fn = getattr(loss_fn, "fn", loss_fn)
        keras_own = getattr(fn, "__module__", "").startswith("keras.")
        if keras_own or object_state.get_on(loss_fn, _WHOLE_BATCH) is not None:
            continue
        whole = False  # not probed: as a mean over rows
        meta = compat.torch_core().device_scope("meta")
        with contextlib.suppress(Exception), meta:
            whole = loss_fn.call(y_true, y_pred).dim() == 0
        object_state.set_on(loss_fn, _WHOLE_BATCH, whole)


def _flat_losses(model):
    compiled = getattr(model, "_compile_loss", None)
    return [entry[1] for entry in getattr(compiled, "_flat_losses", None) or ()]


def over_global_batch(compiled, step):
    """`compiled(y_true, y_pred, sample_weight)` on `step`'s global batch."""
    from keras.src import tree

    def call(y_true, y_pred, sample_weight=None):
        counts, share = step.count()

        def gather(x, with_grad=False):
            return _gather(x, step, counts, share, with_grad, mask=True)

        return compiled(
            tree.map_structure(gather, y_true),
            tree.map_structure(lambda x: gather(x, True), y_pred),
            tree.map_structure(gather, sample_weight),
        )

    return call
