"""A vocabulary-sharded embedding's gradient, computed shard only (DTensor
computes the whole table's on every rank)."""

import functools

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_dtensor.backend import layout
from keras_dtensor.backend.shards import from_local

__all__ = ["wrap_embedding"]


class _RowShardedLookup(torch.autograd.Function):
    """`embedding(indices, weight)` whose backward stays shard-sized."""

    @staticmethod
    def forward(ctx, weight, indices, lookup):
        ctx.save_for_backward(indices)
        ctx.spec = weight._spec  # its mesh, placements, shape and stride
        return lookup(indices, weight)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        spec = ctx.spec
        mesh, placements, shape = spec.mesh, spec.placements, spec.shape
        # The output gradient's, indices' and weight gradient's placements.
        out = []
        for weight_p, index_p in zip(
            placements, indices.placements, strict=True
        ):
            if weight_p.is_shard(0):  # rows: every index, masked locally
                out.append((Replicate(), Replicate(), weight_p))
            elif weight_p.is_shard(1):  # features: this rank's columns
                out.append((Shard(indices.ndim), Replicate(), weight_p))
            elif index_p.is_shard():  # a replicated table, sharded indices
                out.append((index_p, index_p, Partial()))
            else:
                out.append((Replicate(), Replicate(), Replicate()))
        grad_placements, index_placements, out = zip(*out, strict=True)
        grad = grad.redistribute(mesh, grad_placements).to_local()
        local = indices.redistribute(mesh, index_placements).to_local()
        (start, rows), _ = layout.local_slices(shape, mesh, placements)
        held = (local >= start) & (local < start + rows)
        local = torch.where(held, local - start, 0)
        grad = grad * held.unsqueeze(-1).to(grad.dtype)
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad, local, rows, -1, False
        )
        grad_weight = from_local(grad_weight, mesh, out, shape, spec.stride)
        return grad_weight, None, None


def wrap_embedding(original):
    """Wraps `torch.nn.functional.embedding` for row-sharded tables."""

    @functools.wraps(original)
    def embedding(input, weight, *args, **kwargs):
        options = [v for k, v in kwargs.items() if k != "norm_type"]
        if (
            not isinstance(weight, DTensor)
            or args
            or any(v not in (None, False) for v in options)
            or not weight.requires_grad
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or not any(p.is_shard(0) for p in weight.placements)
        ):
            return original(input, weight, *args, **kwargs)
        if not isinstance(input, DTensor):  # a global value, as in forward
            mesh = weight.device_mesh
            input = DTensor.from_local(
                input, mesh, [Replicate()] * mesh.ndim, run_check=False
            )
        return _RowShardedLookup.apply(weight, input, original)

    return embedding
