"""Keras's `reshape` in a tensor-parallel model's local run: a shape from
the model's config (keras_hub's attention, by its global head count) made
local (`model_parallel.local_reshape`); the DTensor run that the local run
is checked against notes each result's layout. Everywhere else it returns
at once."""

import functools

import torch

from keras_dtensor import model_parallel

__all__ = ["wrap_reshape"]


def wrap_reshape(original):
    """Wraps Keras's torch `reshape(x, newshape)`."""

    @functools.wraps(original)
    def reshape(x, newshape):
        # (Checked first: a traced call must not read the context.)
        if torch.compiler.is_compiling():
            return original(x, newshape)
        record = model_parallel.recorder()
        if record is not None:
            out = original(x, newshape)
            record.note_reshape(x, out)
            return out
        shape = model_parallel.local_reshape(x, newshape)
        return original(x, newshape if shape is None else shape)

    return reshape
