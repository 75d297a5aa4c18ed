"""`BatchNormalization(synchronized=True)`: statistics of the global batch.

Keras accepts `synchronized=True` only on TensorFlow ("synchronizes the
global batch statistics ... across all devices at each training step");
torch's answer is `SyncBatchNorm`. Under `DataParallel` each process
normalizes its rows; with the flag, the mean and variance are those of the
global batch, as one process computes them:

- each rank sums `x` and `x**2` over the reduction axes and counts the
  elements; one all-reduce of `[sum, sum of squares, count]` per layer per
  step gives the global mean and `E[x^2] - E[x]^2` (Keras's torch formula);
- backward all-reduces the gradient of those sums, weighted so that,
  after the gradient reducer scales each rank's gradients by its share of
  the rows, every path through the statistics counts once (exact with an
  uneven last batch too).

Moving mean and variance are then updated from global values, equal on
every rank. Under `ModelParallel` a batch-sharded input already reduces
over the global batch (DTensor), and in one process there is nothing to
synchronize: there, and without the flag, Keras's own `moments` runs.
"""

import functools
import inspect

import torch
import torch.distributed as dist

from keras_dtensor import context
from keras_dtensor.launch import multi_process

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
        # This rank's share of the elements: the gradient reducer scales
        # this rank's gradients by its share of the rows, the same ratio.
        ctx.share = float(local[-1] / total[-1])
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
    count = 1
    for axis in axes:
        count *= x.shape[axis]
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
    variance = (total[channels:-1] / total[-1]).reshape(kept) - torch.square(
        mean
    )
    return mean.to(dtype), variance.to(dtype)


def wrap_moments(original):
    """Wraps the torch backend's `nn.moments(x, axes, keepdims, ...)`."""

    @functools.wraps(original)
    def moments(x, axes, keepdims=False, synchronized=False):
        if (
            synchronized
            and multi_process()
            and context.is_data_parallel()
            and isinstance(x, torch.Tensor)
        ):
            axes = tuple(a % x.dim() for a in axes)
            return _global_moments(x, axes, keepdims)
        return original(x, axes, keepdims=keepdims, synchronized=False)

    return moments
