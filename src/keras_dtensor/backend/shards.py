"""A rank's shard of a global value (a plain tensor, alike on every
process) as a DTensor, with no communication.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor.backend.layout import contiguous_strides
from keras_dtensor.backend.layout import local_slices

__all__ = ["from_local", "shard_global_tensor"]


def from_local(local, mesh, placements, shape, stride=None):
    """A DTensor of global `shape` and `stride` (default: contiguous) from
    this rank's `local` shard, unchecked: no collective."""
    if stride is None:
        stride = contiguous_strides(shape)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )


def shard_global_tensor(tensor, layout):
    """This rank's shard of `tensor` by a checked `DTensorLayout`."""
    mesh = layout.device_mesh
    placements = tuple(layout.placements)
    dims = [p.dim for p in placements if p.is_shard()]
    # Dims sharded over one mesh dim each, none partial: what Replicate ->
    # Shard computes, without its planning.
    if (
        not tensor.requires_grad
        and len(set(dims)) == len(dims) > 0
        and all(p.is_shard() or p.is_replicate() for p in placements)
    ):
        ranges = local_slices(tensor.shape, mesh, placements)
        local = tensor[tuple(slice(s, s + n) for s, n in ranges)]
        return from_local(
            local.contiguous(), mesh, placements, tensor.shape, tensor.stride()
        )
    replicated = DTensor.from_local(
        tensor, mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    if all(p.is_replicate() for p in placements):
        return replicated
    return replicated.redistribute(mesh, placements)  # a local chunk
