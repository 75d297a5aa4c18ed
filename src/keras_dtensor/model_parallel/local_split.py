"""A tensor-parallel `Dense` or `EinsumDense` in a local run, on its shards.

Weights read as local shards, the contraction placed by `local_shards`, a
row split's partial sum all-reduced on return: the DTensor run's values,
op for op. A call that cannot be placed sends the layer to DTensors for good.
"""

import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate

from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.layout import placed_shape
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import local_shards
from keras_dtensor.ops import einsum_plan

__all__ = ["call", "runs_on_shards"]

_STATE = "_keras_dtensor_local_split"
_NEVER = object()


def _eligible(layer):
    from keras.layers import Dense
    from keras.layers import EinsumDense

    return (
        type(layer).call in (Dense.call, EinsumDense.call)
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
    )


@dataclasses.dataclass(frozen=True)
class _SplitLayout:
    """A layer on its shards for one layout of its inputs: per input None
    or `(local shape, placements, global shape, mesh dims copied in)`."""

    weights: tuple
    inputs: tuple
    summed: list

    def current(self):
        return all(v._value is value for v, value, _ in self.weights)


def _plan(replay, layer, flat, recorded):
    """A `_SplitLayout`, `_NEVER`, or None (not for these inputs)."""
    mesh, batch_dim = replay.mesh, replay.record.run_spec.dim
    weights, split_axes = [], set()
    for variable in layer.weights:
        value = variable._value
        if not isinstance(value, DTensor) or value.device_mesh != mesh:
            return _NEVER
        grad = list(value.placements)
        for m, p in enumerate(value.placements):
            if mesh.size(m) == 1:
                continue  # whole along an axis of one process
            if m == batch_dim:
                if not p.is_replicate():
                    return _NEVER  # gathered over the batch axis
                grad[m] = Partial()  # this rank's rows' share
            elif p.is_shard():
                split_axes.add(m)
        weights.append((variable, value, tuple(grad)))
    if not split_axes:
        return _NEVER
    inputs = []
    for x, spec in zip(flat, recorded, strict=True):
        if spec is None or not isinstance(x, torch.Tensor):
            inputs.append(None)
            continue
        placements, shape = spec
        if any(p.is_partial() for p in placements):
            return None
        copied = tuple(
            m
            for m in sorted(split_axes)
            if isinstance(placements[m], Replicate)
        )
        local = placed_shape(shape, mesh, placements)
        inputs.append((local, placements, shape, copied))
    summed = _summed(layer, [x for x in inputs if x is not None], mesh)
    if summed is None:
        return _NEVER
    return _SplitLayout(tuple(weights), tuple(inputs), summed)


def call(replay, layer, original, args, kwargs, flat, recorded):
    """`(True, outputs)` of `layer` on its shards, or `(False, None)`."""
    state = object_state.get_on(layer, _STATE)
    if state is None:
        state = object_state.set_on(layer, _STATE, _eligible(layer))
    record = replay.record
    if not state or id(layer) in record.replicated:
        return False, None
    # Once per layer and inputs' layout, again when a weight is replaced.
    key = (id(layer), recorded)
    plan = record.split_plans.get(key)
    if plan is None or not plan.current():
        plan = _plan(replay, layer, flat, recorded)
        if plan is _NEVER:
            return _never(layer)
        if plan is None:
            return False, None
        record.split_plans[key] = plan
    mesh, summed = replay.mesh, plan.summed
    known, inputs, changed = [], [], False
    for x, entry in zip(flat, plan.inputs, strict=True):
        if entry is None:
            inputs.append(x)
            continue
        local, placements, shape, copied = entry
        if isinstance(x, DTensor) or tuple(x.shape) != local:
            return False, None
        if copied:
            y = _copied(replay, x, mesh, copied)
            changed, x = changed or y is not x, y
        known.append((x, placements, shape))
        inputs.append(x)
    if changed:  # rebuilt only when an input was replaced
        args, kwargs = fast_tree.pack_sequence_as((args, kwargs), inputs)
    bias = getattr(layer, "bias", None)
    locals_ = local_grads.local_many(
        [value for _, value, _ in plan.weights],
        [grad for _, _, grad in plan.weights],
    )
    for (variable, value, _), local in zip(plan.weights, locals_, strict=True):
        known.append((local, value.placements, tuple(value.shape)))
        if summed and variable is bias:  # as DTensor: each rank's share
            local = local_shards.share(local, mesh.size(summed[0]))
        variable._value = local
    # Keras checks the input's last dim against the whole kernel's.
    try:
        with (
            object_state.swapped(layer, "_input_spec", None),
            local_shards.scope(mesh, known) as (_, _, pending),
        ):
            outputs = original(layer, *args, **kwargs)
    except local_shards.Unsupported:
        return _never(layer)  # nothing written: the layer is pure
    finally:
        for variable, value, _ in plan.weights:
            variable._value = value
    if sorted(pending) != summed:
        raise RuntimeError(
            f"keras-dtensor: {layer.name!r} on its shards left partial sums "
            f"over mesh dims {sorted(pending)}, where {summed} were planned "
            f"(mesh {mesh})."
        )
    if summed:
        outputs = local_shards.all_reduce(outputs, [mesh.get_group(summed[0])])
    return True, outputs


def _summed(layer, inputs, mesh):
    """The mesh dims of the contraction's partial sum (`[]` or one), or
    None: one input, no redistribution, no activation after a sum."""
    from keras import activations
    from keras.layers import EinsumDense

    kernel = getattr(layer, "_kernel", None)
    if len(inputs) != 1 or kernel is None:
        return None
    _, placements, shape, _ = inputs[0]
    if isinstance(layer, EinsumDense):
        subscripts = layer.equation
    else:
        subscripts = einsum_plan.matmul_subscripts(len(shape))
    value = kernel._value
    specs = (
        (tuple(placements), tuple(shape)),
        (tuple(value.placements), tuple(value.shape)),
    )
    found = subscripts and einsum_plan.plan_for(subscripts, mesh, specs)
    if not found or any(
        t != spec[0] for t, spec in zip(found[0], specs, strict=True)
    ):
        return None
    summed = [m for m, p in enumerate(found[2]) if p.is_partial()]
    bias = getattr(layer, "bias", None)
    if summed and (
        len(summed) > 1
        or layer.activation not in (None, activations.linear)
        or (
            bias is not None
            and not bias._value.placements[summed[0]].is_replicate()
        )
    ):
        return None
    return summed


def runs_on_shards(layer):
    """Whether `layer`'s calls in a local run run on its shards."""
    return object_state.get_on(layer, _STATE) is True


def _never(layer):
    object_state.set_on(layer, _STATE, False)
    return False, None


def _copied(replay, x, mesh, axes):
    """`x` through `copy_in` over `axes`, once for consecutive calls."""
    last, out, last_axes = replay.copied
    if last is x and last_axes == tuple(axes):
        return out
    out = local_shards.copy_in(x, [mesh.get_group(m) for m in axes])
    replay.copied = (x, out, tuple(axes))
    return out
