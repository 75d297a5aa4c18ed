"""Adam's update on local shards, in bounded pieces, with Keras's arithmetic
(Keras's torch `Adam` keeps temporaries the size of all weights)."""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.ops.flat_buffers import buckets

__all__ = ["wrap_adam_update"]

_PIECE = 1 << 20  # elements


def _local(x):
    # Under no_grad `to_local()` is this tensor.
    return x._local_tensor if isinstance(x, DTensor) else x


def _pieces(rows):
    """Groups of about `_PIECE` elements of pieces of same-shaped `rows`."""
    pieces = []
    for row in rows:
        numel = row[0].numel()
        if numel <= _PIECE or not all(t.is_contiguous() for t in row):
            pieces.append(row)
            continue
        flat = [t.view(-1) for t in row]
        for start in range(0, numel, _PIECE):
            pieces.append(tuple(f[start : start + _PIECE] for f in flat))
    sizes = [piece[0].numel() for piece in pieces]
    groups = buckets(sizes, _PIECE, spill=False)
    return [[pieces[i] for i in group] for group in groups]


def _step_size(optimizer, learning_rate, dtype):
    """`lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)` as Keras computes it."""
    convert_to_tensor = compat.torch_core().convert_to_tensor

    lr = _local(convert_to_tensor(learning_rate)).to(dtype)
    t = (_local(convert_to_tensor(optimizer.iterations)) + 1).to(dtype)
    decay_1 = torch.pow(torch.tensor(optimizer.beta_1, dtype=dtype), t)
    decay_2 = torch.pow(torch.tensor(optimizer.beta_2, dtype=dtype), t)
    return lr * torch.sqrt(1 - decay_2) / (1 - decay_1)


def _update(optimizer, group, step_size):
    """Adam on one group of pieces: `(value, m, v[, v_hat], grad)` each."""
    values, m, v = ([p[i] for p in group] for i in range(3))
    grads = [p[-1] for p in group]
    beta_1, beta_2 = optimizer.beta_1, optimizer.beta_2
    torch._foreach_mul_(m, beta_1)
    torch._foreach_add_(m, grads, alpha=1 - beta_1)
    torch._foreach_mul_(v, beta_2)
    squares = torch._foreach_mul(grads, grads)
    torch._foreach_add_(v, squares, alpha=1 - beta_2)
    del squares
    if optimizer.amsgrad:
        v_hat = [p[3] for p in group]
        torch._foreach_maximum_(v_hat, v)
        v = v_hat
    numerators = torch._foreach_mul(m, step_size)
    denominators = torch._foreach_add(torch._foreach_sqrt(v), optimizer.epsilon)
    steps = torch._foreach_div(numerators, denominators)
    del numerators, denominators
    torch._foreach_add_(values, steps, alpha=-1)


def wrap_adam_update(original):
    """Wraps Keras's torch `Adam._parallel_update_step` (see the module)."""

    @functools.wraps(original)
    def _parallel_update_step(self, grads, variables, learning_rate):
        if not variables or not isinstance(variables[0].value, DTensor):
            return original(self, grads, variables, learning_rate)
        index = self._get_variable_index
        rows = []
        for grad, variable in zip(grads, variables, strict=True):
            i = index(variable)
            slots = [self._momentums[i], self._velocities[i]]
            if self.amsgrad:
                slots.append(self._velocity_hats[i])
            row = [variable.value, *(s.value for s in slots), grad]
            # DTensors of one mesh, placements and local shape, else Keras.
            if not all(
                isinstance(t, DTensor)
                and t.device_mesh == row[0].device_mesh
                and t.placements == row[0].placements
                and t._local_tensor.shape == row[0]._local_tensor.shape
                for t in row
            ):
                return original(self, grads, variables, learning_rate)
            rows.append(tuple(_local(t) for t in row))
        step_size = _step_size(self, learning_rate, rows[0][0].dtype)
        for group in _pieces(rows):
            _update(self, group, step_size)

    return _parallel_update_step
