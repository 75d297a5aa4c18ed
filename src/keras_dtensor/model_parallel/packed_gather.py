"""Many shards gathered by one all-gather, their gradients scattered back by
one reduce-scatter, as FSDP2 gathers a group of parameters.

Each rank packs its shards side by side in one flat buffer, each padded to
`torch.chunk`'s chunk so every rank's pack has one size.
"""

import functools

import torch
import torch.distributed as dist

from keras_dtensor.backend import layout
from keras_dtensor.ops.flat_buffers import offsets

__all__ = ["Pending", "finish"]


def _collective(name, old):
    """torch 2.13's `name`, else `old`; looked up at each call, as FSDP2
    does, so a tool replacing torch's collectives replaces these too."""
    return getattr(dist, name, None) or getattr(dist, old)


@functools.lru_cache(maxsize=256)
def _pack_layout(specs, world, rank):
    """Per `(dim, shape)`: `(dim, shape, this rank's rows, the padded
    chunk's shape, each rank's (rank, first row, rows), start and size in
    the pack)`, and the pack's size."""
    out = []
    for dim, shape in specs:
        n, rest = shape[dim], (*shape[:dim], *shape[dim + 1 :])
        chunks = [(r, *layout.chunk(n, world, r)) for r in range(world)]
        spans = tuple(chunk for chunk in chunks if chunk[2])
        out.append((dim, shape, chunks[rank][2], (chunks[0][2], *rest), spans))
    places = offsets([entry[3] for entry in out])
    out = [(*entry, *place) for entry, place in zip(out, places, strict=True)]
    return tuple(out), sum(places[-1]) if places else 0


class Pending:
    """A packed all-gather in flight: `finish` it, or `wait()` for values."""

    def __init__(self, shards, specs, group):
        self.group = group
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.layout, self.size = _pack_layout(tuple(specs), self.world, rank)
        with torch.no_grad():
            pack = shards[0].new_empty(self.size)
            for shard, (dim, _, rows, padded, _, at, n) in zip(
                shards, self.layout, strict=True
            ):
                if rows:
                    piece = pack[at : at + n].view(padded)
                    piece[:rows].copy_(shard.movedim(dim, 0))
            self.gathered = pack.new_empty(self.world * pack.numel())
            gather = _collective("all_gather_single", "all_gather_into_tensor")
            self.work = gather(self.gathered, pack, group=group, async_op=True)
        self.like = pack.new_empty(0)

    def wait(self):
        """The full tensors, each with its own storage (once only)."""
        self.work.wait()
        gathered = self.gathered.view(self.world, -1)
        self.gathered = self.work = None
        out = []
        with torch.no_grad():
            for dim, shape, _, padded, spans, at, n in self.layout:
                full = gathered.new_empty(shape)
                rows = full.movedim(dim, 0)
                for r, first, count in spans:
                    piece = gathered[r, at : at + n].view(padded)
                    rows[first : first + count].copy_(piece[:count])
                out.append(full)
        return tuple(out)


class _GatherShards(torch.autograd.Function):
    """The full tensors `pending` gathers; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, pending, *shards):
        ctx.pending = pending
        return pending.wait()

    @staticmethod
    def backward(ctx, *grads):
        pending = ctx.pending
        # The padding's sums are never read: only a missing grad is zeroed.
        packs = pending.like.new_empty((pending.world, pending.size))
        for grad, (dim, _, _, padded, spans, at, n) in zip(
            grads, pending.layout, strict=True
        ):
            if grad is None:
                packs[:, at : at + n].zero_()
                continue
            moved = grad.movedim(dim, 0)
            for r, first, count in spans:
                piece = packs[r, at : at + n].view(padded)
                piece[:count].copy_(moved[first : first + count])
        local = packs.new_empty(pending.size)
        scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
        scatter(local, packs.reshape(-1), group=pending.group)
        out = [None]
        for dim, _, rows, padded, _, at, n in pending.layout:
            shard = local[at : at + n].view(padded)[:rows].movedim(0, dim)
            out.append(shard.contiguous())
        return tuple(out)


def finish(pending, shards):
    """The full tensors of `pending` (`shards`, one dtype, packed by
    `Pending`); backward reduce-scatters their gradients."""
    return _GatherShards.apply(pending, *shards)
