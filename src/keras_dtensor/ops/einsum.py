"""`einsum` over DTensors on local shards, by its subscripts.

torch runs `torch.einsum` over DTensors by its decomposition: permutes,
reshapes and a `bmm`. Where a reshape merges a sharded dim with another
(a kernel's heads with its head size, which torch's einsum does for some
shapes, e.g. one token at a time in keras_hub's `generate`), the merged
dim is `_StridedShard`, which `bmm` has no rule for: the kernel is
gathered whole on every rank, or a column-split layer's output comes out
as a pending sum to all-reduce. torch's tensor parallelism never does
either: a column split's output stays sharded, a row split's is one
pending sum.

Here the layout follows from the subscripts, as for `mm`: on each mesh
dim, one letter is sharded (the same letter in every operand that has
it); an operand with that letter but replicated is cut to its
shard (no communication); the output is sharded on the letter, or a
pending sum when the letter is summed over. The einsum then runs once on
the local shards, through Keras's own code (its dtype rules). Where two
letters are sharded on one mesh dim (Gemma's query groups against a
single key/value head cut unevenly), one stays (one that leaves no rank
empty, then the one cutting the most elements) and the operands cut on
another are gathered first.
Anything else (an ellipsis, a repeated or broadcast letter, a pending sum
or any other placement as input, plain tensors among DTensors) is left to
torch.
"""

import functools

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

__all__ = ["shard_plan", "wrap_einsum"]


def _subscripts(subscripts, operands):
    text = subscripts.replace(" ", "")
    if "..." in text or "->" not in text:
        return None
    inputs, output = text.split("->")
    inputs = inputs.split(",")
    if len(inputs) != len(operands):
        return None
    for sub, x in zip(inputs, operands, strict=True):
        if len(sub) != x.ndim or len(set(sub)) != len(sub):
            return None
    return inputs, output


def shard_plan(subscripts, operands):
    """How to run an einsum of DTensors on local shards.

    Returns `(input placements, input gradient placements, output
    placements, output global shape)`, or None where the subscripts or
    layouts are not of the kind handled here.
    """
    parsed = _subscripts(subscripts, operands)
    if parsed is None:
        return None
    inputs, output = parsed
    mesh = operands[0].device_mesh
    if any(x.device_mesh != mesh for x in operands):
        return None
    sizes = {}
    for sub, x in zip(inputs, operands, strict=True):
        for letter, n in zip(sub, x.shape, strict=True):
            if sizes.setdefault(letter, n) != n:
                return None  # broadcast over a letter
    targets = [list(x.placements) for x in operands]
    grads = [list(x.placements) for x in operands]
    placements = []
    for m in range(mesh.ndim):
        letters = {}  # sharded letter -> elements of the operands it cuts
        for sub, x in zip(inputs, operands, strict=True):
            p = x.placements[m]
            if p.is_replicate():
                continue
            if type(p) is not Shard:
                return None
            letters[sub[p.dim]] = letters.get(sub[p.dim], 0) + x.numel()
        if not letters:
            placements.append(Replicate())
            continue
        # Two letters on one mesh dim (query groups against one key/value
        # head): a letter every rank holds part of stays over one that
        # leaves a rank empty, then the one cutting the most elements;
        # operands cut on another are gathered (the same on every rank).
        letter = min(
            letters,
            key=lambda k: (sizes[k] < mesh.size(m), -letters[k], k),
        )
        for i, sub in enumerate(inputs):
            if letter in sub:
                targets[i][m] = grads[i][m] = Shard(sub.index(letter))
            else:
                targets[i][m] = Replicate()
                # Its gradient sums over the letter's shards.
                grads[i][m] = Partial()
        placements.append(
            Shard(output.index(letter)) if letter in output else Partial()
        )
    # One dim over several mesh dims (given, or after the cuts): left to
    # torch.
    for target in targets:
        dims = [p.dim for p in target if isinstance(p, Shard)]
        if len(dims) != len(set(dims)):
            return None
    shape = tuple(sizes[letter] for letter in output)
    return targets, grads, placements, shape


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
        # Operands may be Keras variables (`EinsumDense`'s kernel).
        if (
            not any(
                isinstance(getattr(x, "_value", x), DTensor) for x in operands
            )
            or torch.compiler.is_compiling()
        ):
            return original(subscripts, *operands, **kwargs)
        from keras.src.backend.torch.core import convert_to_tensor

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
            if list(x.placements) != target:
                x = x.redistribute(mesh, target)
            local.append(x.to_local(grad_placements=grad))
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
