"""A compiled loss that is no mean over rows, over the global batch.

The reducer's row weighting is exact only for a mean over rows; a loss
reduced otherwise, or one from outside Keras returning one value for the
whole batch, runs on the gathered global batch, `y_pred` with autograd.
"""

import contextlib

from keras_dtensor import compat
from keras_dtensor.backend import object_state
from keras_dtensor.data_parallel import global_batch_losses
from keras_dtensor.data_parallel.batch_split import gather_rows

__all__ = ["needs_global", "over_global_batch"]

_GLOBAL = ("sum", "mean_with_sample_weight")
_WHOLE_BATCH = "_keras_dtensor_whole_batch_loss"


def needs_global(model):
    """Whether `model` compiled a loss that is no mean over rows."""
    return any(
        getattr(loss_fn, "reduction", None) in _GLOBAL
        or object_state.get_on(loss_fn, _WHOLE_BATCH)
        for loss_fn in _flat_losses(model)
    )


def probe(model, y_true, y_pred):
    """Notes which losses from outside Keras return one value for the
    whole batch, on the meta tensors of Keras's symbolic build."""
    from keras.src import tree

    if tree.is_nested(y_true) or tree.is_nested(y_pred):
        return
    for loss_fn in _flat_losses(model):
        fn = getattr(loss_fn, "fn", loss_fn)
        if getattr(fn, "__module__", "").startswith("keras."):
            continue
        if object_state.get_on(loss_fn, _WHOLE_BATCH) is not None:
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
    import torch
    from keras.src import tree
    from keras.src.backend.common.masking import get_keras_mask
    from keras.src.backend.common.masking import set_keras_mask

    def call(y_true, y_pred, sample_weight=None):
        counts = step.count()
        share = step.rows / step.global_rows

        def gather(x, with_grad=False):
            if (
                not isinstance(x, torch.Tensor)
                or x.dim() == 0
                or x.shape[0] != step.rows
            ):
                return x
            mask = get_keras_mask(x)
            if with_grad and x.requires_grad:
                out = global_batch_losses.gather_with_grad(x, counts, share)
            else:
                out = gather_rows(x.detach(), counts)
            if mask is not None:
                set_keras_mask(out, gather_rows(mask, counts))
            return out

        return compiled(
            tree.map_structure(gather, y_true),
            tree.map_structure(lambda x: gather(x, True), y_pred),
            tree.map_structure(gather, sample_weight),
        )

    return call
