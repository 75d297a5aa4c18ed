"""Many shards gathered by one all-gather, their gradients scattered by one
reduce-scatter.

FSDP2 gathers a group of parameters as one flat buffer: each rank packs
its shards side by side, one `all_gather_into_tensor` brings every rank's
pack, and each parameter is cut back out of it. Backward does the reverse
with one `reduce_scatter_tensor`. Per collective, gloo and NCCL pay a
fixed latency that small weights never amortize, so a group costs far
less than one collective per weight.

Shards follow `torch.chunk` (DTensor's `Shard`): rank r holds rows
`[r*c, min((r+1)*c, n))` of the sharded dim, c = ceil(n / world); each is
padded to c rows in the pack so every rank's pack has the same size.
"""

import math

import torch
import torch.distributed as dist

__all__ = ["gather_shards"]


def _rows(n, world, rank):
    chunk = math.ceil(n / world)
    return chunk, max(0, min(chunk, n - rank * chunk))


class _GatherShards(torch.autograd.Function):
    """forward(group, world, rank, specs, *shards) -> full tensors."""

    @staticmethod
    def forward(ctx, group, world, rank, specs, *shards):
        ctx.group, ctx.world, ctx.rank, ctx.specs = group, world, rank, specs
        ctx.like = shards[0].new_empty(0)
        pieces = []
        for shard, (dim, shape) in zip(shards, specs, strict=True):
            chunk, _ = _rows(shape[dim], world, rank)
            moved = shard.movedim(dim, 0)
            padded = moved.new_zeros((chunk, *moved.shape[1:]))
            padded[: moved.shape[0]] = moved
            pieces.append(padded.reshape(-1))
        pack = torch.cat(pieces)
        gathered = pack.new_empty(world * pack.numel())
        dist.all_gather_into_tensor(gathered, pack, group=group)
        gathered = gathered.view(world, pack.numel())
        out, offset = [], 0
        for piece, (dim, shape) in zip(pieces, specs, strict=True):
            chunk, _ = _rows(shape[dim], world, rank)
            rest = (*shape[:dim], *shape[dim + 1 :])
            part = gathered[:, offset : offset + piece.numel()]
            offset += piece.numel()
            full = part.reshape(world * chunk, *rest)
            out.append(full[: shape[dim]].movedim(0, dim).contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        world, rank = ctx.world, ctx.rank
        parts = []
        for grad, (dim, shape) in zip(grads, ctx.specs, strict=True):
            chunk, _ = _rows(shape[dim], world, rank)
            if grad is None:
                grad = ctx.like.new_zeros(shape)
            moved = grad.movedim(dim, 0)
            padded = moved.new_zeros((world * chunk, *moved.shape[1:]))
            padded[: moved.shape[0]] = moved
            parts.append(padded.reshape(world, -1))
        packs = torch.cat(parts, dim=1)
        local = packs.new_empty(packs.shape[1])
        dist.reduce_scatter_tensor(local, packs.reshape(-1), group=ctx.group)
        out, offset = [], 0
        for part, (dim, shape) in zip(parts, ctx.specs, strict=True):
            chunk, rows = _rows(shape[dim], world, rank)
            rest = (*shape[:dim], *shape[dim + 1 :])
            piece = local[offset : offset + part.shape[1]]
            offset += part.shape[1]
            shard = piece.reshape(chunk, *rest)[:rows].movedim(0, dim)
            out.append(shard.contiguous())
        return (None, None, None, None, *out)


def gather_shards(shards, specs, group):
    """Full tensors from this rank's `shards`, all in one collective.

    Args:
        shards: this rank's local shards (plain tensors, one dtype).
        specs: `(dim, global shape)` of each: the dim sharded over `group`.
        group: the process group of the mesh axis they are sharded on.

    Returns:
        A tuple of full tensors; backward reduce-scatters their gradients
        (summed over the group) back to the shards.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    return _GatherShards.apply(group, world, rank, tuple(specs), *shards)
