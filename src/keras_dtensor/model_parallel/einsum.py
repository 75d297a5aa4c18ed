"""Keras's torch `einsum` and `matmul` on local shards, by subscripts.

An einsum of DTensors runs once on the local shards, placed by its
subscripts (`ops.einsum_plan`), not by torch's decomposition, whose merged
`_StridedShard` dims `bmm` can only gather. See docs/internals/local-run.md.
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.backend.layout import contiguous_strides
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import local_shards
from keras_dtensor.ops import einsum_plan

__all__ = ["wrap_einsum", "wrap_matmul"]


def _global_stride(local, shape):
    """Global strides in the local result's dim order (a permuted view)."""
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), d))
    strides = contiguous_strides([shape[d] for d in order])
    out = [0] * local.ndim
    for d, step in zip(order, strides, strict=True):
        out[d] = step
    return tuple(out)


def _tensors(values):
    convert_to_tensor = compat.torch_core().convert_to_tensor
    return [convert_to_tensor(x) for x in values]


def wrap_einsum(original):
    """Wraps Keras's torch `einsum(subscripts, *operands)`."""

    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        # (Checked first: a traced call must not read the context.)
        if torch.compiler.is_compiling():
            return original(subscripts, *operands, **kwargs)
        if local_shards.active():  # a split layer's call on its shards
            return local_shards.contract(
                subscripts,
                _tensors(operands),
                lambda *local: original(subscripts, *local, **kwargs),
            )
        # Operands may be Keras variables (`EinsumDense`'s kernel).
        if not any(
            isinstance(getattr(x, "_value", x), DTensor) for x in operands
        ):
            return original(subscripts, *operands, **kwargs)
        operands = _tensors(operands)
        mesh = getattr(operands[0], "device_mesh", None)
        found = all(
            isinstance(x, DTensor) and x.device_mesh == mesh for x in operands
        ) and einsum_plan.plan_for(
            subscripts,
            mesh,
            tuple((tuple(x.placements), tuple(x.shape)) for x in operands),
        )
        if not found:
            return original(subscripts, *operands, **kwargs)
        targets, grads, placements, shape = found
        operands = [
            x if tuple(x.placements) == t else x.redistribute(mesh, t)
            for x, t in zip(operands, targets, strict=True)
        ]
        local = local_grads.local_many(operands, grads)
        out = original(subscripts, *local, **kwargs)
        if _global_stride(out, tuple(out.shape)) != out.stride():
            out = out.contiguous()  # not a permuted dense result
        return DTensor.from_local(
            out,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=_global_stride(out, shape),
        )

    return einsum


def wrap_matmul(original):
    """Wraps Keras's torch `matmul(x1, x2)` for `local_shards.scope`."""

    @functools.wraps(original)
    def matmul(x1, x2):
        if torch.compiler.is_compiling() or not local_shards.active():
            return original(x1, x2)
        x1, x2 = _tensors((x1, x2))
        subscripts = einsum_plan.matmul_subscripts(x1.ndim)
        if x2.ndim != 2 or subscripts is None:
            raise local_shards.Unsupported("a matmul of another kind")
        return local_shards.contract(subscripts, [x1, x2], original)

    return matmul
