"""Around `fit`: the same model on every rank before, equal replicas after."""

import functools

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import context
from keras_dtensor.backend import launch
from keras_dtensor.backend.placement_order import stable_hash
from keras_dtensor.hooks import malloc_trim

__all__ = ["check_replicas", "check_same_model", "wrap_fit"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 18  # elements of a local weight summed at a time


def _checksum(value):
    """The int64 sum of a local weight's bits, through one buffer."""
    local = value.to_local() if isinstance(value, DTensor) else value
    flat = local.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    chunks = bits.split(_CHUNK)
    size = min(_CHUNK, bits.numel())
    buffer = torch.empty(size, dtype=torch.int64, device=bits.device)
    sums = torch.empty(len(chunks), dtype=torch.int64, device=bits.device)
    for i, chunk in enumerate(chunks):
        part = buffer[: chunk.numel()]
        part.copy_(chunk)
        torch.sum(part, dim=0, out=sums[i])
    return sums.sum()


def _replica_of(value, world):
    """For each rank, the first rank that holds the same local values."""
    if not isinstance(value, DTensor):
        return [0] * world  # a plain tensor: every rank is a replica
    ranks = value.device_mesh.mesh
    sharded = [
        i for i, p in enumerate(value.placements) if not p.is_replicate()
    ]
    first_of_key, replica = {}, [None] * world
    for index in np.ndindex(*ranks.shape):
        rank = int(ranks[index])
        key = tuple(index[d] for d in sharded)
        replica[rank] = first_of_key.setdefault(key, rank)
    return replica


def check_replicas(model):
    """Raises on every rank if replicas of trainable weights differ."""
    world, _ = launch.world()
    variables = list(model.trainable_weights)
    if world == 1 or not variables:
        return
    values = [v.value for v in variables]
    sums = torch.stack([_checksum(v).cpu() for v in values]).tolist()
    gathered = launch.all_gather_int_lists(sums)
    differ = {}  # (rank, its replica) -> paths
    for i, value in enumerate(values):
        for rank, first in enumerate(_replica_of(value, world)):
            if gathered[rank][i] != gathered[first][i]:
                differ.setdefault((rank, first), []).append(variables[i].path)
    if differ:
        (rank, first), paths = next(iter(differ.items()))
        raise RuntimeError(
            f"After fit, rank {rank}'s copy of {len(paths)} weight(s) "
            f"differs from rank {first}'s, which should hold the same values "
            f"(first: {paths[:3]}; {world} processes). The ranks trained on "
            "different data or ran different code: check that every rank "
            "feeds the same global batches and seeds, and that callbacks "
            "do the same on every rank."
        )


def _signature(weight):
    placements = None
    if isinstance(weight.value, DTensor):
        placements = tuple(str(p) for p in weight.value.placements)
    return (tuple(weight.shape), str(weight.dtype), placements)


def check_same_model(model):
    """Raises on every rank unless all built the same weights (not paths)."""
    world, _ = launch.world()
    if world == 1:
        return
    signatures = [_signature(w) for w in model.weights]
    digests = launch.all_gather_ints(stable_hash(signatures))
    if len(set(digests)) == 1:
        return
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    counts = launch.all_gather_ints(len(signatures))
    detail = f"weights per rank: {counts}"
    if len(set(counts)) == 1:
        per_weight = launch.all_gather_int_lists(
            [stable_hash(s) for s in signatures]
        )
        columns = enumerate(zip(*per_weight, strict=True))
        index = next(i for i, column in columns if len(set(column)) > 1)
        shape, dtype, placements = signatures[index]
        detail = (
            f"first difference: weight #{index}, here "
            f"{model.weights[index].path} {shape} {dtype} {placements}"
        )
    raise RuntimeError(
        f"The processes built different models: ranks {odd} of {world} "
        "differ from rank 0 in their weights' shapes, dtypes or layouts "
        f"({detail}). Build the same model with the same arguments and "
        "layout map on every process."
    )


def wrap_fit(original):
    """Wraps `TorchTrainer.fit`: checks before and after."""

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        # Without a distribution each process trains alone: no collective.
        checked = context.current() is not None and launch.multi_process()
        if checked:
            check_same_model(self)
            malloc_trim.release_free_memory()
        history = original(self, *args, **kwargs)
        if checked:
            check_replicas(self)
        return history

    return fit
