"""Weights sharded over the batch axis, gathered by the layer that uses them.

A `LayoutMap` key with the batch axis (`("batch", None)`) is how Keras
writes FSDP: the weight is split over the same processes that split the
batch. Left to DTensor, every op that meets a batch-sharded activation and
a batch-sharded weight picks its own redistribution, op by op, in forward
and again in backward: activations all-reduced, weights gathered several
times, many times FSDP2's collectives (the benchmark history has the
counts).

FSDP2 gathers a module's parameters before its forward and reduce-scatters
their gradients in backward. The same here, at the Keras layer: during
the call of a layer, its own trainable variables that are sharded over the
batch axis read as their gathered value (one all-gather each, other mesh
axes left as they are). Every op inside the layer then sees a replicated
weight and a batch-sharded activation and needs no communication; the
backward of the gather reduce-scatters the weight's gradient back to its
shard, so no gradient of those weights is ever reduced whole.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor.backend import object_state

__all__ = ["batch_placement", "gathered_weights"]

_PLAN = "_keras_dtensor_weight_gather"


def batch_placement(value, batch_axis):
    """`(mesh dim of the batch axis, its Shard placement or None)` for a
    DTensor on a mesh with the batch axis; None otherwise. The one place
    that decides "sharded over the batch axis", for both the per-layer
    gather here and the local path (`local_run`)."""
    if not isinstance(value, DTensor):
        return None
    names = value.device_mesh.mesh_dim_names or ()
    if batch_axis not in names:
        return None
    dim = names.index(batch_axis)
    placement = value.placements[dim]
    return dim, placement if placement.is_shard() else None


def _gather_targets(value, batch_axis):
    """Placements of `value` with the batch axis gathered, or None."""
    found = batch_placement(value, batch_axis)
    if found is None or found[1] is None:
        return None
    dim = found[0]
    placements = list(value.placements)
    placements[dim] = Replicate()
    return tuple(placements)


def _plan(layer, batch_axis):
    """`((variable, placements), ...)` of the layer's own trainable
    variables to gather, cached on the layer until its variables change
    (LoRA adds some after build)."""
    own = layer.__dict__.get("_trainable_variables")
    if not own:
        return ()
    cached = object_state.get_on(layer, _PLAN)
    if cached is not None and cached[0] == len(own):
        return cached[1]
    plan = []
    for variable in own:
        targets = _gather_targets(getattr(variable, "_value", None), batch_axis)
        if targets is not None:
            plan.append((variable, targets))
    return object_state.set_on(layer, _PLAN, (len(own), tuple(plan)))[1]


@contextlib.contextmanager
def _swapped(plan):
    saved = []
    try:
        for variable, placements in plan:
            shard = variable._value
            variable._value = shard.redistribute(shard.device_mesh, placements)
            saved.append((variable, shard))
        yield
    finally:
        for variable, shard in saved:
            variable._value = shard


def gathered_weights(layer, distribution):
    """A context in which `layer`'s batch-sharded weights read gathered.

    Returns a null context at once when the layer has none (every layer
    of a layout without the batch axis), or while torch.compile traces.
    """
    if not layer.built or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    plan = _plan(layer, distribution.batch_dim_name)
    if not plan:
        return contextlib.nullcontext()
    return _swapped(plan)
