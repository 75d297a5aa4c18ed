"""Weights sharded over the batch axis, gathered by the layer that uses them.

Outside a local run, a layer's own batch-sharded trainable variables read
gathered during its call (one all-gather each), as FSDP2 gathers a
module's parameters: the ops inside need no communication, and the
gather's backward reduce-scatters the gradient to the shard.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor.backend import object_state

__all__ = ["batch_placement", "gathered_weights"]

_PLAN = "_keras_dtensor_weight_gather"


def batch_placement(value, batch_axis):
    """`(batch axis's mesh dim, its Shard or None)`, or None when `value`
    is no DTensor on a mesh with the batch axis."""
    if not isinstance(value, DTensor):
        return None
    names = value.device_mesh.mesh_dim_names or ()
    if batch_axis not in names:
        return None
    dim = names.index(batch_axis)
    placement = value.placements[dim]
    return dim, placement if placement.is_shard() else None


def _plan(layer, batch_axis):
    """`(variable, gathered placements)` of the layer's own trainable
    variables, cached until their number changes (LoRA)."""
    own = layer.__dict__.get("_trainable_variables")
    if not own:
        return ()
    cached = object_state.get_on(layer, _PLAN)
    if cached is not None and cached[0] == len(own):
        return cached[1]
    plan = []
    for variable in own:
        value = getattr(variable, "_value", None)
        found = batch_placement(value, batch_axis)
        if found is not None and found[1] is not None:
            placements = list(value.placements)
            placements[found[0]] = Replicate()
            plan.append((variable, tuple(placements)))
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
    """A context in which `layer`'s batch-sharded weights read gathered."""
    if not layer.built or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    plan = _plan(layer, distribution.batch_dim_name)
    if not plan:
        return contextlib.nullcontext()
    return _swapped(plan)
