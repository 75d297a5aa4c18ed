"""BatchNormalization under DataParallel: statistics of the global batch.

As on JAX, `ops.moments` over the batch axis (`$KERAS_DTENSOR_SYNC_BATCH_NORM`,
or `synchronized=True`) takes one all-reduce a layer a step; other axes and
masked statistics stay local.
"""

import functools
import inspect
import math

import torch
import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor.backend import context
from keras_dtensor.backend.launch import multi_process

__all__ = ["wrap_batch_norm_init", "wrap_moments"]


def wrap_batch_norm_init(original):
    """Wraps `BatchNormalization.__init__`: `synchronized=True` accepted."""

    @functools.wraps(original)
    def __init__(self, *args, synchronized=False, **kwargs):
        original(self, *args, **kwargs)
        self.synchronized = synchronized

    # Keras reads a layer's constructor arguments from this signature.
    __init__.__signature__ = inspect.signature(original)
    return __init__


class _WeightedSum(torch.autograd.Function):
    """All-reduce (sum) whose backward undoes the reducer's row weighting."""

    @staticmethod
    def forward(ctx, local):
        total = local.clone()
        dist.all_reduce(total)
        # This rank's share, the reducer's weight (a tensor: no host sync).
        ctx.share = local[-1] / total[-1]
        return total

    @staticmethod
    def backward(ctx, grad):
        weighted = grad * ctx.share
        dist.all_reduce(weighted)
        return weighted / ctx.share


def _global_moments(x, axes, keepdims):
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # as Keras does for float16 statistics
    count = math.prod(x.shape[axis] for axis in axes)
    local = torch.cat(
        [
            torch.sum(x, dim=axes).reshape(-1),
            torch.sum(torch.square(x), dim=axes).reshape(-1),
            torch.tensor([float(count)], dtype=x.dtype, device=x.device),
        ]
    )
    total = _WeightedSum.apply(local)
    channels = (total.numel() - 1) // 2
    kept = [1 if i in axes else n for i, n in enumerate(x.shape)]
    if not keepdims:
        kept = [n for i, n in enumerate(x.shape) if i not in axes]
    mean = (total[:channels] / total[-1]).reshape(kept)
    square = (total[channels:-1] / total[-1]).reshape(kept)
    return mean.to(dtype), (square - torch.square(mean)).to(dtype)


def wrap_moments(original):
    """Wraps the torch backend's `nn.moments(x, axes, keepdims, ...)`."""

    @functools.wraps(original)
    def moments(x, axes, keepdims=False, synchronized=False):
        if (
            multi_process()
            and context.is_data_parallel()
            and isinstance(x, torch.Tensor)
            and not x.is_meta  # shapes only: nothing to sum
        ):
            axes = tuple(a % x.dim() for a in axes)
            # Over the batch axis only: per-sample statistics stay.
            if synchronized or (0 in axes and config.get("SYNC_BATCH_NORM")):
                return _global_moments(x, axes, keepdims)
        return original(x, axes, keepdims=keepdims, synchronized=False)

    return moments
