"""`einsum` over DTensors on local shards, by its subscripts.

torch runs `torch.einsum` over DTensors by its decomposition: permutes,
reshapes and a `bmm`. Where a reshape merges a sharded dim with another
(a kernel's heads with its head size, which torch's einsum does for some
shapes, e.g. one token at a time in keras_hub's `generate`), the merged
dim is `_StridedShard`, which `bmm` has no rule for: the kernel is
gathered whole on every rank, or a column-split layer's output comes out
as a partial sum to all-reduce. torch's tensor parallelism never does
either: a column split's output stays sharded, a row split's is one
partial sum.

Here the layout follows from the subscripts, as for `mm`: on each mesh
dim, one letter is sharded (the same letter in every operand that has
it); an operand with that letter but replicated is cut to its
shard (no communication); the output is sharded on the letter, or a
partial sum when the letter is summed over. The einsum then runs once on
the local shards, through Keras's own code (its dtype rules). Where two
letters are sharded on one mesh dim (Gemma's query groups against a
single key/value head cut unevenly), one stays (one that leaves no rank
empty, then the one cutting the most elements) and the operands cut on
another are gathered first.
Anything else (an ellipsis, a repeated or broadcast letter, a partial sum
or any other placement as input, plain tensors among DTensors) is left to
torch.
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor import compat
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import local_shards
from keras_dtensor.ops.einsum_plan import matmul_subscripts
from keras_dtensor.ops.einsum_plan import plan_for

__all__ = ["shard_plan", "wrap_einsum", "wrap_matmul"]


def shard_plan(subscripts, operands):
    """How to run an einsum of DTensors on local shards.

    Returns `(input placements, input gradient placements, output
    placements, output global shape)`, or None where the subscripts or
    layouts are not of the kind handled here. A function of the
    subscripts, the mesh and each operand's placements and shape, so it is
    worked out once per signature (a layer's einsum repeats every step and
    every token).
    """
    mesh = operands[0].device_mesh
    if any(x.device_mesh != mesh for x in operands):
        return None
    specs = tuple((tuple(x.placements), tuple(x.shape)) for x in operands)
    return plan_for(subscripts, mesh, specs)


def _global_stride(local, shape):
    """The global strides laid out in the local result's dim order (a
    permuted view stays one)."""
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), d))
    stride, step = [0] * local.ndim, 1
    for d in reversed(order):
        stride[d] = step
        step *= max(shape[d], 1)
    return tuple(stride)


def wrap_einsum(original):
    """Wraps Keras's torch `einsum(subscripts, *operands)`: DTensor
    operands run on their local shards by `shard_plan`."""

    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        # (Checked first: a traced call must not read the context.)
        if torch.compiler.is_compiling():
            return original(subscripts, *operands, **kwargs)
        if local_shards.active():  # a split layer's call on its shards
            convert_to_tensor = compat.torch_core().convert_to_tensor

            return local_shards.contract(
                subscripts,
                [convert_to_tensor(x) for x in operands],
                lambda *local: original(subscripts, *local, **kwargs),
            )
        # Operands may be Keras variables (`EinsumDense`'s kernel).
        if not any(
            isinstance(getattr(x, "_value", x), DTensor) for x in operands
        ):
            return original(subscripts, *operands, **kwargs)
        convert_to_tensor = compat.torch_core().convert_to_tensor

        operands = [convert_to_tensor(x) for x in operands]
        if not all(isinstance(x, DTensor) for x in operands):
            return original(subscripts, *operands, **kwargs)
        found = shard_plan(subscripts, operands)
        if found is None:
            return original(subscripts, *operands, **kwargs)
        targets, grads, placements, shape = found
        mesh = operands[0].device_mesh
        local = []
        for x, target, grad in zip(operands, targets, grads, strict=True):
            if tuple(x.placements) != target:
                x = x.redistribute(mesh, target)
            local.append(local_grads.local(x, grad))
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
    """Wraps Keras's torch `matmul(x1, x2)`: inside a split layer's call on
    its local shards (`local_shards.scope`), a `Dense` kernel's product
    is placed by the einsum rules; everywhere else it returns at once."""

    @functools.wraps(original)
    def matmul(x1, x2):
        if torch.compiler.is_compiling() or not local_shards.active():
            return original(x1, x2)
        convert_to_tensor = compat.torch_core().convert_to_tensor

        x1, x2 = convert_to_tensor(x1), convert_to_tensor(x2)
        subscripts = matmul_subscripts(x1.ndim)
        if x2.ndim != 2 or subscripts is None:
            raise local_shards.Unsupported("a matmul of another kind")
        return local_shards.contract(subscripts, [x1, x2], original)

    return matmul
