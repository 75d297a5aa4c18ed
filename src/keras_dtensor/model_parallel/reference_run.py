"""The DTensor run a local run is checked against, as it ran.

Inside `recording(Record(...))`, nested layer calls with weights, and the
model's own reshapes and `slice_update`s, note their layouts; the local
run then follows the `Record`.
"""

import contextvars
import dataclasses
import functools

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend.layout import even_shards
from keras_dtensor.backend.layout import placed_shape

__all__ = [
    "Record",
    "even",
    "fingerprint",
    "next_key",
    "recorder",
    "recording",
    "spec",
]

_RECORDING = contextvars.ContextVar("keras_dtensor_recording", default=None)


def spec(x):
    """A DTensor leaf's `(placements, global shape)`; None for others."""
    if isinstance(x, DTensor):
        return tuple(x.placements), tuple(x.shape)
    return None


def even(recorded, mesh, skip=None):
    """Whether a recorded spec has no partial sums and even shards."""
    if recorded is None:
        return False
    placements, shape = recorded
    return not any(p.is_partial() for p in placements) and even_shards(
        shape, mesh, placements, skip=skip
    )


def next_key(counts, layer):
    """`(id(layer), n)` of the layer's n-th call so far, counted."""
    key = (id(layer), counts.get(id(layer), 0))
    counts[id(layer)] = key[1] + 1
    return key


@dataclasses.dataclass
class Record:
    """A DTensor run's layer calls: `calls[(id(layer), n)]`, the input specs
    of a weighted layer's n-th call; `boundary`, ids of the layers run as
    DTensors; `replicated`, those whose outputs leave replicated."""

    boundary: set
    run_spec: object
    calls: dict = dataclasses.field(default_factory=dict)
    outputs: tuple = ()
    counts: dict = dataclasses.field(default_factory=dict)
    # `{key: (fingerprint, output specs)}`, while tracing a difference.
    fingerprints: dict | None = None
    between: int = 0  # layer calls that run locally
    # The model's own sublayers; the boundary ones with sharded outputs.
    children: frozenset = frozenset()
    sharded_outputs: list = dataclasses.field(default_factory=list)
    replicated: frozenset = frozenset()
    # Reshape plans, `slice_update` specs: outside boundary layers, in order.
    reshapes: list = dataclasses.field(default_factory=list)
    slice_updates: list = dataclasses.field(default_factory=list)
    inside: int = 0  # boundary layer calls under way
    split_plans: dict = dataclasses.field(default_factory=dict)
    # Layers (ids; None: the model) meeting a boundary output cut unevenly.
    uneven: set = dataclasses.field(default_factory=set)
    stack: list = dataclasses.field(default_factory=list)

    def _whole(self, specs):
        return all(s is None or self.run_spec.whole(s[0]) for s in specs)

    def enter(self, layer, args, kwargs):
        """Notes a nested layer call; returns its key."""
        key = next_key(self.counts, layer)
        self.stack.append(id(layer))
        if not (
            id(layer) in self.boundary
            or layer.__dict__.get("_trainable_variables")
            or layer.__dict__.get("_non_trainable_variables")
        ):
            self.between += 1
            return key
        inputs = tuple(spec(x) for x in fast_tree.flatten((args, kwargs)))
        if not self._whole(inputs):
            self.boundary.add(id(layer))
        self.inside += id(layer) in self.boundary
        self.calls[key] = inputs
        self.between += id(layer) not in self.boundary
        return key

    @functools.cached_property
    def kept(self):
        """Indices of the weights the local run leaves as DTensors."""
        ids = {
            id(variable)
            for sub in self.run_spec.layers
            if id(sub) in self.boundary
            for variable in sub.weights
        }
        return self.run_spec.kept | frozenset(
            i
            for i, (variable, _, _) in enumerate(self.run_spec.weights)
            if id(variable) in ids
        )

    def leave(self, key, outputs):
        specs = tuple(spec(x) for x in fast_tree.flatten(outputs))
        if self.fingerprints is not None:
            self.fingerprints[key] = (fingerprint(outputs), specs)
        layer_id = key[0]
        self.stack.pop()
        if layer_id not in self.boundary:
            return
        self.inside -= 1
        mesh, dim = self.run_spec.mesh, self.run_spec.dim
        if not self.inside and not all(
            s is None or even(s, mesh, skip=dim) for s in specs
        ):
            self.uneven.add(self.stack[-1] if self.stack else None)
        if (
            layer_id in self.children
            and layer_id not in self.sharded_outputs
            and not self._whole(specs)
        ):
            self.sharded_outputs.append(layer_id)

    def note_reshape(self, x, out):
        """Notes a reshape's `(input's local shape, result's global and
        local shapes)`; None where shards differ in size (ranks may part)."""
        if self.inside:
            return
        before, after, mesh = spec(x), spec(out), self.run_spec.mesh
        plan = None
        if even(before, mesh) and even(after, mesh):
            plan = (
                torch.Size(placed_shape(before[1], mesh, before[0])),
                after[1],
                placed_shape(after[1], mesh, after[0]),
            )
        self.reshapes.append(plan)

    def note_slice_update(self, inputs, out):
        """Notes a `slice_update`'s updated tensor and result."""
        if not self.inside:
            self.slice_updates.append((spec(inputs), spec(out)))


def recording(record):
    """A context in which layer calls are noted in `record`."""
    return context.scoped(_RECORDING, record)


def recorder():
    """The `Record` of the DTensor run in progress, or None."""
    return _RECORDING.get()


def fingerprint(outputs):
    """This rank's share of each output tensor, summed two ways."""
    out = []
    for x in fast_tree.flatten(outputs):
        if isinstance(x, torch.Tensor):
            local = x.to_local() if isinstance(x, DTensor) else x
            local = local.detach().double()
            sums = (local.sum().item(), local.abs().sum().item())
            out.append((tuple(local.shape), *sums))
    return tuple(out)
