"""Which models run on local tensors (`local_run`), decided once.

A model's `LocalRunSpec` is cached on it until a variable is created
anywhere (LoRA adds weights after build).
"""

import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Shard

from keras_dtensor import config
from keras_dtensor.backend import object_state
from keras_dtensor.model_parallel import fsdp_blocks

__all__ = [
    "LocalRunSpec",
    "adding_losses",
    "forget",
    "spec_for",
    "variables_changed",
]

_PLAN = "_keras_dtensor_local_batch"
# Variables created, in Keras's global state (reset by `clear_session`):
# cached specs are rebuilt when it moves, without walking the weights.
_CREATED = "keras_dtensor_variables_created"


@dataclasses.dataclass(frozen=True)
class LocalRunSpec:
    """How one model runs locally: `(variable, gather, grad placements)`
    per weight; `kept`, indices of those sharded over a non-batch axis
    (left as DTensors), and `boundary`, the ids of the layers owning them."""

    mesh: object
    dim: int
    weights: tuple
    layers: tuple
    gathered: tuple
    kept: frozenset = frozenset()
    boundary: frozenset = frozenset()

    def whole(self, placements):
        """Whether `placements` shard rows over the batch axis only."""
        return all(
            (i == self.dim and p == Shard(0)) or _whole_along(self.mesh, i, p)
            for i, p in enumerate(placements)
        )


def _created():
    """The count of variables created (a list in Keras's global state)."""
    from keras.src.backend.common import global_state

    count = global_state.get_global_attribute(_CREATED)
    if count is None:
        count = [0]
        global_state.set_global_attribute(_CREATED, count)
    return count


def variables_changed():
    """Called when a variable is created: cached plans are rebuilt."""
    _created()[0] += 1


def _build(layer, batch_axis):
    """The spec, or None; the layers owning a model-sharded weight are the
    boundary (not the model, nor one with weighted sublayers)."""
    from keras.src.layers.normalization.batch_normalization import (
        BatchNormalization,
    )

    weights = layer.weights
    layers = tuple(layer._flatten_layers(include_self=True))
    if not weights or any(
        isinstance(sub, BatchNormalization) or sub._seed_generators
        for sub in layers
    ):
        return None
    mesh, dim, items, sharded = None, None, [], set()
    for variable in weights:
        value = getattr(variable, "_value", None)
        found = fsdp_blocks.batch_placement(value, batch_axis)
        if found is None:
            if not isinstance(value, DTensor):
                return None
            found = (None, None)  # no batch axis: tensor-parallel only
        if mesh is None:
            mesh, dim = value.device_mesh, found[0]
        elif value.device_mesh != mesh:
            return None
        shard = found[1]
        if shard is not None and type(shard) is not Shard:  # e.g. strided
            return None
        if not all(
            _whole_along(mesh, i, p)
            for i, p in enumerate(value.placements)
            if i != dim
        ):
            if not config.get("LOCAL_MODEL"):
                return None
            sharded.add(id(variable))
            items.append((variable, False, None))
            continue
        batch_ranks = 1 if dim is None else mesh.size(dim)
        grad = list(value.placements)
        if shard is None and batch_ranks > 1:
            grad[dim] = Partial()  # this rank's rows' share of the sum
        gather = shard is not None and batch_ranks > 1
        items.append((variable, gather, tuple(grad)))
    index = {id(variable): i for i, (variable, _, _) in enumerate(items)}
    boundary, kept = set(), {index[v] for v in sharded}
    for sub in layers if sharded else ():
        own = [*sub._trainable_variables, *sub._non_trainable_variables]
        if not any(id(variable) in sharded for variable in own):
            continue
        if sub is layer or any(
            inner.weights for inner in sub._flatten_layers(include_self=False)
        ):
            return None
        boundary.add(id(sub))
        kept.update(index[id(v)] for v in own if id(v) in index)
    return LocalRunSpec(
        mesh,
        dim,
        tuple(items),
        layers,
        tuple(i for i, item in enumerate(items) if item[1] and i not in kept),
        frozenset(kept),
        frozenset(boundary),
    )


def _whole_along(mesh, dim, placement):
    """Whether `placement` on mesh dim `dim` leaves the tensor whole."""
    return placement.is_replicate() or mesh.size(dim) == 1


def forget(layer):
    """The model runs as DTensors until a variable is created."""
    cached = object_state.get_on(layer, _PLAN)
    if cached is not None:
        object_state.set_on(layer, _PLAN, (*cached[:2], None))


def spec_for(layer, distribution):
    """The layer's `LocalRunSpec`, or None when it must run as DTensors."""
    if not layer.built or torch.compiler.is_compiling():
        return None
    count = _created()
    cached = object_state.get_on(layer, _PLAN)
    if cached is None or cached[0] is not count or cached[1] != count[0]:
        built = None
        if config.get("LOCAL_BATCH"):
            built = _build(layer, distribution.batch_dim_name)
        cached = object_state.set_on(layer, _PLAN, (count, count[0], built))
    return cached[2]


def adding_losses(layers):
    """The layers holding a plain-tensor loss (one rank's share)."""
    return [
        sub
        for sub in layers
        if any(
            isinstance(loss, torch.Tensor) and not isinstance(loss, DTensor)
            for loss in sub._losses
        )
    ]
