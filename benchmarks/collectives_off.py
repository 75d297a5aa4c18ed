"""Collectives made local no-ops, and the collectives a call dispatches.

A `*_no_collectives` benchmark variant calls `collectives_off` once
warm: every collective becomes a local copy of the right shape, so the
numbers are wrong but the host work is the same, and a variant's time
minus its twin's is what its collectives cost.
"""

import collections

__all__ = ["collectives_off", "count_collectives"]


class _Done:  # what an `async_op=True` collective returns: complete
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def collectives_off(ddp=None):
    """Local copies in place of `torch.distributed`'s collectives and its
    functional ones (what DTensor, FSDP2 and keras-dtensor call); `ddp`: a
    DDP module whose buckets its C++ reducer reduces, given a comm hook
    that keeps each bucket."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def done(*args, async_op=False, **kwargs):  # all_reduce, broadcast
        return _Done() if async_op else None

    def all_gather_single(output, input, group=None, async_op=False):
        # FSDP2 gathers in place: its input is a view of the output
        piece = input.reshape(1, -1).clone()
        output.view(dist.get_world_size(group), -1).copy_(piece)
        return done(async_op=async_op)

    def reduce_scatter_single(
        output, input, op=None, group=None, async_op=False
    ):
        output.view(-1).copy_(input.reshape(dist.get_world_size(group), -1)[0])
        return done(async_op=async_op)

    def all_gather(tensors, tensor, group=None, async_op=False):
        for t in tensors:
            t.copy_(tensor)
        return done(async_op=async_op)

    def functional_size(group):
        resolved = funcol._resolve_group(group)  # a name, in torch 2.13
        if isinstance(resolved, str):
            by_name = dist.distributed_c10d._get_group_size_by_name
            return by_name(resolved)
        return dist.get_world_size(resolved)

    def gather(tensor, gather_dim, group, *args, **kwargs):
        copies = [tensor] * functional_size(group)
        return torch.cat(copies, dim=gather_dim)

    def scatter(tensor, op, scatter_dim, group, *args, **kwargs):
        parts = tensor.chunk(functional_size(group), dim=scatter_dim)
        return parts[0].contiguous()

    dist.all_reduce = dist.broadcast = done
    dist.all_gather = all_gather
    for name in ("all_gather_single", "all_gather_into_tensor"):
        setattr(dist, name, all_gather_single)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        setattr(dist, name, reduce_scatter_single)

    def batch_isend_irecv(ops):
        return []

    batch_isend_irecv.collectives_off = True  # not counted as a batch
    dist.batch_isend_irecv = batch_isend_irecv
    funcol.all_reduce = lambda tensor, *args, **kwargs: tensor.clone()
    funcol.all_gather_single = gather
    funcol.reduce_scatter_single = scatter

    def keep(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    if ddp is not None:
        ddp.register_comm_hook(None, keep)


def count_collectives(call):
    """The collectives `call()` dispatches, by op (CommDebugMode also tracks
    modules, which Keras's nested layer calls trip up)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "c10d" in func.namespace:
                name = func.overloadpacket.__name__.strip("_")
                # not collectives: waits, and a wrap for autograd
                if not name.startswith(("wait", "wrap")):
                    self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    with Collectives() as mode:
        call()
    return dict(mode.counts)
