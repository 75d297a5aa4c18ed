"""A rank's shard of a global value, as a DTensor.

Keras programs are single-program: a plain tensor is the global value,
the same on every process. Laying it out by a layout keeps this rank's
shard, with no communication (`shard_global_tensor`): every batch of a
ModelParallel step, every variable's initial value and
`keras.distribution.distribute_tensor` of a plain tensor come here.
"""

from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor.backend.layout import local_slices

__all__ = ["shard_global_tensor"]


def shard_global_tensor(tensor, layout):
    """Cuts this rank's shard out of a global value held by every rank.

    No communication: every rank holds the same global `tensor` (Keras's
    single-program semantics) and keeps its own slice. A tensor that
    needs a gradient goes through DTensor's `redistribute`, so the
    gradient of `tensor` is the full (gathered) gradient on every rank;
    any other (a batch, an initial value) is sliced directly.

    Args:
        tensor: a plain `torch.Tensor` with the global shape.
        layout: a `DTensorLayout`, already checked against the tensor's
            shape (see `as_backend_layout`).

    Returns:
        A `DTensor`.
    """
    mesh = layout.device_mesh
    placements = tuple(layout.placements)
    if not tensor.requires_grad and _cut_here(placements):
        # What Replicate -> Shard computes (`torch.chunk`'s chunks),
        # without redistribute's planning: every batch of a step comes
        # here. Not differentiable: with a gradient, the slow way.
        local = tensor
        for dim, (start, length) in enumerate(
            local_slices(tensor.shape, mesh, placements)
        ):
            if length != tensor.shape[dim]:
                local = local.narrow(dim, start, length)
        return DTensor.from_local(
            local.contiguous(),
            mesh,
            placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    replicated = DTensor.from_local(
        tensor, mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    if all(p.is_replicate() for p in placements):
        return replicated
    # Replicate -> Shard is a local chunk: no communication.
    return replicated.redistribute(mesh, placements)


def _cut_here(placements):
    """Whether this rank's shard can be cut out directly: some dims
    sharded, each over one mesh dim (several mesh dims over one tensor dim
    take DTensor's shard order), nothing else but replication."""
    dims = [p.dim for p in placements if p.is_shard()]
    return (
        bool(dims)
        and len(set(dims)) == len(dims)
        and all(p.is_shard() or p.is_replicate() for p in placements)
    )
