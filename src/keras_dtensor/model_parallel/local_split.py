"""A tensor-parallel `Dense` or `EinsumDense` in a local run, on its shards.

In a local run (`local_run`), a boundary layer (`boundary_layers`) runs as
DTensors: its inputs wrapped, every op of its call dispatched by DTensor,
forward and backward, its outputs reduced and unwrapped. For the two
layers that carry tensor parallelism in Keras and keras_hub models (a
column or row split `Dense`/`EinsumDense`, no LoRA, not quantized, Keras's
own `call`), the same computation runs here on local tensors:

- the weights read as their local shards (gradients laid out as the
  weights, a partial sum over the batch axis where the batch is split);
- an input replicated over a model axis its weights are split on passes
  through `local_shards.copy_in` (backward sums its gradient over that
  axis: torch's `ColwiseParallel` input), once for consecutive layers
  given the same tensor (query, key and value), as the DTensor run does;
- the layer's contraction is placed by `local_shards` (a row split's
  partial sum all-reduced at once), the rest of its call is elementwise.

The values are those of the DTensor run, op for op (the exactness check
of the local run compares them); where this cannot place a call, the layer
runs as DTensors from then on.
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
from keras_dtensor.ops.einsum_plan import matmul_subscripts
from keras_dtensor.ops.einsum_plan import plan_for

__all__ = ["call", "runs_on_shards"]

_STATE = "_keras_dtensor_local_split"
_NEVER = object()


def _eligible(layer):
    from keras.layers import Dense
    from keras.layers import EinsumDense

    for cls in (Dense, EinsumDense):
        if isinstance(layer, cls) and type(layer).call is cls.call:
            return not getattr(layer, "lora_enabled", False) and (
                getattr(layer, "quantization_mode", None) is None
            )
    return False


@dataclasses.dataclass(frozen=True)
class _SplitLayout:
    """How one layer runs on its shards for one layout of its inputs:
    `weights` `(variable, DTensor value, gradient placements)`; `inputs`
    per flat input None (passed as it is) or `(local shape, placements,
    global shape, mesh dims its gradient is summed over)`; `summed` the
    mesh dims of the contraction's partial sum (`[]` or one)."""

    weights: tuple
    inputs: tuple
    summed: list

    def current(self):
        return all(v._value is value for v, value, _ in self.weights)


def _plan(replay, layer, flat, recorded):
    """A `_SplitLayout`, `_NEVER` (the layer cannot run on shards) or None (not
    for these inputs)."""
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
    known, inputs = [], []
    for x, spec in zip(flat, recorded, strict=True):
        if spec is None or not isinstance(x, torch.Tensor):
            inputs.append(None)
            continue
        placements, shape = spec
        if isinstance(x, DTensor) or any(p.is_partial() for p in placements):
            return None
        local = placed_shape(shape, mesh, placements)
        if tuple(x.shape) != local:
            return None
        copied = tuple(
            m
            for m in sorted(split_axes)
            if isinstance(placements[m], Replicate)
        )
        known.append((x, placements, shape))
        inputs.append((local, placements, shape, copied))
    summed = _summed(layer, known, mesh)
    if summed is None:
        return _NEVER
    return _SplitLayout(tuple(weights), tuple(inputs), summed)


def call(replay, layer, original, args, kwargs, flat, recorded):
    """Runs boundary layer `layer` on local shards.

    Returns `(True, outputs)`, or `(False, None)` when it must run as
    DTensors (decided on its first call, kept on the layer).
    """
    state = object_state.get_on(layer, _STATE)
    if state is False:
        return False, None
    if state is None:
        state = object_state.set_on(layer, _STATE, _eligible(layer))
        if not state:
            return False, None
    record = replay.record
    if id(layer) in record.replicated:
        return False, None
    # Worked out once per layer and layout of its inputs (every token of
    # `generate` asks again), again when a weight's value is replaced.
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
            changed = changed or y is not x
            x = y
        known.append((x, placements, shape))
        inputs.append(x)
    if changed:
        args, kwargs = fast_tree.pack_sequence_as((args, kwargs), inputs)
    bias = getattr(layer, "bias", None)
    for variable, value, grad in plan.weights:
        local = local_grads.local(value, grad)
        known.append((local, value.placements, tuple(value.shape)))
        if summed and variable is bias:
            # DTensor adds a replicated bias to a partial sum as each
            # rank's share of it.
            local = local_shards.share(local, mesh.size(summed[0]))
        variable._value = local
    # Keras checks the input's last dim against the whole kernel's; the
    # DTensor run passed it with the global shape. Set aside for the call.
    try:
        with (
            object_state.swapped(layer, "_input_spec", None),
            local_shards.scope(mesh, known) as pending,
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
    """The mesh dims over which the layer's contraction leaves pending
    sums (`[]` or one dim), or None for a call this cannot place: one
    input, its product with the kernel placed without redistribution,
    and no activation after a partial sum (DTensor would reduce first)."""
    from keras import activations
    from keras.layers import EinsumDense

    kernel = getattr(layer, "_kernel", None)
    if len(inputs) != 1 or kernel is None:
        return None
    x, x_placements, x_shape = inputs[0]
    value = kernel._value
    if isinstance(layer, EinsumDense):
        subscripts = layer.equation
    else:
        subscripts = matmul_subscripts(len(x_shape))
        if subscripts is None:
            return None
    specs = (
        (tuple(x_placements), tuple(x_shape)),
        (tuple(value.placements), tuple(value.shape)),
    )
    found = plan_for(subscripts, mesh, specs)
    if found is None or any(
        t != spec[0] for t, spec in zip(found[0], specs, strict=True)
    ):
        return None
    summed = [m for m, p in enumerate(found[2]) if p.is_partial()]
    if len(summed) > 1:
        return None
    if summed and layer.activation not in (None, activations.linear):
        return None
    bias = getattr(layer, "bias", None)
    if summed and bias is not None:
        if not bias._value.placements[summed[0]].is_replicate():
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
