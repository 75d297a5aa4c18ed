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
padded to c rows in the pack so every rank's pack has the same size (the
padding's contents are never read).
"""

import functools
import math

import torch
import torch.distributed as dist

from keras_dtensor.backend import layout

__all__ = ["Pending", "finish", "gather_shards", "start"]


# torch 2.13 renamed these (`*_single`) and warns on every call of the old
# names; older torch has only the old ones. Looked up at each call, as
# FSDP2 does, so a tool that replaces `torch.distributed`'s collectives
# (the benchmarks' no-collectives runs) replaces these too.
def _all_gather(*args, **kwargs):
    gather = getattr(dist, "all_gather_single", None)
    return (gather or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter(*args, **kwargs):
    scatter = getattr(dist, "reduce_scatter_single", None)
    return (scatter or dist.reduce_scatter_tensor)(*args, **kwargs)


def _rows(n, world, rank):
    """The chunk size of a dim of `n` over `world`, and `rank`'s rows."""
    return layout.chunk(n, world, 0)[1], layout.chunk(n, world, rank)[1]


def _spans(n, world, chunk):
    """`(rank, first row, end row)` of each rank's rows of a dim of `n`."""
    for rank in range(world):
        first = rank * chunk
        end = min(first + chunk, n)
        if end > first:
            yield rank, first, end


@functools.lru_cache(maxsize=256)
def _pack_layout(specs, world, rank):
    """Per spec `(dim, shape)`: `(size in the pack, chunk, this rank's
    rows, the padded chunk's view shape, every rank's spans)`; the same
    for every step of a group, so computed once."""
    out = []
    for dim, shape in specs:
        chunk, rows = _rows(shape[dim], world, rank)
        size = chunk * math.prod(shape) // max(shape[dim], 1)
        spans = tuple(_spans(shape[dim], world, chunk))
        out.append((size, chunk, rows, (chunk, *_rest(shape, dim)), spans))
    return tuple(out)


class Pending:
    """An all-gather of packed shards in flight; `wait()` gives the full
    tensors (each its own contiguous storage, the same layout every time).

    Each shard is written into its place in one flat pack, padded to its
    chunk; the full tensors are written straight out of the gathered
    packs: one copy each way. The padding is never read back, so it is
    left as it is (no pass to zero the pack)."""

    def __init__(self, shards, specs, group):
        self.specs, self.group = tuple(specs), group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout = _pack_layout(self.specs, self.world, self.rank)
        self.sizes = [size for size, *_ in self.layout]
        with torch.no_grad():
            pack = shards[0].new_empty(sum(self.sizes))
            offset = 0
            for shard, (size, _, rows, view, _), (dim, _) in zip(
                shards, self.layout, self.specs, strict=True
            ):
                if rows:
                    piece = pack[offset : offset + size].view(view)
                    piece[:rows].copy_(shard.movedim(dim, 0))
                offset += size
            self.gathered = pack.new_empty(self.world * pack.numel())
            self.work = _all_gather(
                self.gathered, pack, group=group, async_op=True
            )
        self.like = pack.new_empty(0)

    def wait(self):
        """The full tensors, once the gather is done (once: the buffer is
        let go with the returned tensors' copies made)."""
        self.work.wait()
        gathered = self.gathered.view(self.world, -1)
        self.gathered = self.work = None
        out, offset = [], 0
        with torch.no_grad():
            for (size, _, _, view, spans), (dim, shape) in zip(
                self.layout, self.specs, strict=True
            ):
                full = gathered.new_empty(shape)
                rows = full.movedim(dim, 0)
                for rank, first, end in spans:
                    piece = gathered[rank, offset : offset + size].view(view)
                    rows[first:end].copy_(piece[: end - first])
                offset += size
                out.append(full)
        return tuple(out)


def _rest(shape, dim):
    return (*shape[:dim], *shape[dim + 1 :])


class _GatherShards(torch.autograd.Function):
    """forward(pending, *shards) -> the full tensors `pending` gathers;
    backward reduce-scatters their gradients to the shards."""

    @staticmethod
    def forward(ctx, pending, *shards):
        ctx.pending = pending
        return pending.wait()

    @staticmethod
    def backward(ctx, *grads):
        pending = ctx.pending
        world = pending.world
        # Each rank's rows of every gradient written into its row of one
        # (world, total) pack, padded to the chunk: the padding's sums are
        # cut off below, unread, so only a missing gradient is zeroed.
        packs = pending.like.new_empty((world, sum(pending.sizes)))
        offset = 0
        for grad, (size, _, _, view, spans), (dim, _) in zip(
            grads, pending.layout, pending.specs, strict=True
        ):
            if grad is None:
                packs[:, offset : offset + size].zero_()
            else:
                moved = grad.movedim(dim, 0)
                for r, first, end in spans:
                    piece = packs[r, offset : offset + size].view(view)
                    piece[: end - first].copy_(moved[first:end])
            offset += size
        local = packs.new_empty(packs.shape[1])
        _reduce_scatter(local, packs.reshape(-1), group=pending.group)
        out, offset = [], 0
        for (size, _, rows, view, _), (dim, _) in zip(
            pending.layout, pending.specs, strict=True
        ):
            piece = local[offset : offset + size]
            offset += size
            shard = piece.view(view)[:rows].movedim(0, dim)
            out.append(shard.contiguous())
        return (None, *out)


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
    return finish(Pending(shards, specs, group), shards)


def start(shards, specs, group):
    """Starts gathering `shards` (as `gather_shards`) without waiting:
    a `Pending` to pass to `finish` with the same shards, or to `wait()`
    on for the values alone (no gradient)."""
    return Pending(shards, specs, group)


def finish(pending, shards):
    """The full tensors of a started gather, with `gather_shards`'s
    backward to `shards`."""
    return _GatherShards.apply(pending, *shards)
