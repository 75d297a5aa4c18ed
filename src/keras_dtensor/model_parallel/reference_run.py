"""The DTensor run a local run is checked against, as it ran.

`local_run_check` runs a model's call once as DTensors, recording (`recording`)
each nested layer call with weights: its inputs' layouts, whether it joins
the boundary (`boundary_layers`), its outputs' layouts; and the layouts of the
reshapes in the model's own code (`reshapes`). The local run then follows
the `Record`.
"""

import contextlib
import contextvars
import dataclasses

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import fast_tree
from keras_dtensor.backend.layout import even_shards

__all__ = ["Record", "fingerprint", "recorder", "recording", "spec"]

_RECORDING = contextvars.ContextVar("keras_dtensor_recording", default=None)


def spec(x):
    """A DTensor leaf's `(placements, global shape)`; None for others."""
    if isinstance(x, DTensor):
        return tuple(x.placements), tuple(x.shape)
    return None


@dataclasses.dataclass
class Record:
    """A DTensor run's layer calls: `calls[(id(layer), n)]` holds the
    input specs of the n-th call of a layer with weights; `weights` each
    such layer's weights; `outputs` the specs of the model's outputs;
    `boundary` the ids of the layers that run as DTensors."""

    boundary: set
    run_spec: object
    calls: dict = dataclasses.field(default_factory=dict)
    outputs: tuple = ()
    counts: dict = dataclasses.field(default_factory=dict)
    weights: dict = dataclasses.field(default_factory=dict)
    # `{(id(layer), n): fingerprint of its outputs}` of every layer call,
    # when a local run that differed is being traced to its layer.
    fingerprints: dict | None = None
    # Layer calls that run locally: with none (a stack of split Dense
    # layers), the local run only adds conversions at every boundary.
    between: int = 0
    # The model's own sublayers (ids), and those among the boundary
    # layers whose outputs were sharded over a model axis, in call order:
    # the candidates for `replicated`.
    children: frozenset = frozenset()
    sharded_outputs: list = dataclasses.field(default_factory=list)
    # Boundary layers whose outputs leave replicated (all-gathered over
    # the model axes, torch's `output_layouts=Replicate()`): for a model
    # whose own ops meet such an output with a whole tensor (a
    # hidden-split embedding's output in a residual add).
    replicated: frozenset = frozenset()
    # The layouts of each reshape's input and result outside the boundary
    # layers, in call order (None for a plain tensor): a reshape to a
    # shape from the model's config (keras_hub's attention splits its
    # global head count into groups) takes its local shape (`reshapes`).
    reshapes: list = dataclasses.field(default_factory=list)
    reshape_plans: dict = dataclasses.field(default_factory=dict)
    # The same for each `slice_update`: the layouts of the updated tensor
    # and of the result (a replicated KV cache filled with head-sharded
    # keys comes out split by heads: `hooks.slice_update`).
    slice_updates: list = dataclasses.field(default_factory=list)
    inside: int = 0  # boundary layer calls under way
    # `local_split`'s plans, by `(id(layer), its inputs' specs)`.
    split_plans: dict = dataclasses.field(default_factory=dict)
    # The layers (ids) whose own ops meet a boundary layer's output cut
    # into shards of different sizes (a single key/value head over two
    # ranks); None for the model's: on local tensors a rank's ops could
    # fail where its peers' do not, leaving them in a collective.
    uneven: set = dataclasses.field(default_factory=set)
    stack: list = dataclasses.field(default_factory=list)
    _kept: frozenset | None = None

    def enter(self, layer, args, kwargs):
        """Notes a nested layer call of the DTensor run; returns its key.
        Layers with weights get their inputs' layouts noted: a replicated
        weight given sharded inputs joins the boundary (its gradient is a
        sum over the shards, which only the DTensor run makes)."""
        key = (id(layer), self.counts.get(id(layer), 0))
        self.counts[id(layer)] = key[1] + 1
        self.stack.append(id(layer))
        if not (
            id(layer) in self.boundary
            or layer.__dict__.get("_trainable_variables")
            or layer.__dict__.get("_non_trainable_variables")
        ):
            self.between += 1
            return key
        inputs = tuple(spec(x) for x in fast_tree.flatten((args, kwargs)))
        if id(layer) not in self.boundary and not all(
            spec is None or self.run_spec.whole(spec[0]) for spec in inputs
        ):
            self.boundary.add(id(layer))
        self.inside += id(layer) in self.boundary
        self.calls[key] = inputs
        self.weights[id(layer)] = tuple(layer.weights)
        self.between += id(layer) not in self.boundary
        return key

    def kept(self):
        """Indices into the spec's weights of the boundary layers' weights,
        which the local run leaves as DTensors (computed once)."""
        if self._kept is None:
            ids = {
                id(variable)
                for layer_id in self.boundary
                for variable in self.weights.get(layer_id, ())
            }
            self._kept = self.run_spec.kept | frozenset(
                i
                for i, (variable, _, _) in enumerate(self.run_spec.weights)
                if id(variable) in ids
            )
        return self._kept

    def leave(self, key, outputs):
        if self.fingerprints is not None:
            specs = tuple(spec(x) for x in fast_tree.flatten(outputs))
            self.fingerprints[key] = (fingerprint(outputs), specs)
        layer_id = key[0]
        self.stack.pop()
        self.inside -= layer_id in self.boundary
        if layer_id in self.boundary and not self.inside:
            specs = [spec(x) for x in fast_tree.flatten(outputs)]
            if any(self._uneven(s) for s in specs):
                self.uneven.add(self.stack[-1] if self.stack else None)
        if (
            layer_id in self.boundary
            and layer_id in self.children
            and layer_id not in self.sharded_outputs
        ):
            specs = [spec(x) for x in fast_tree.flatten(outputs)]
            if not all(s is None or self.run_spec.whole(s[0]) for s in specs):
                self.sharded_outputs.append(layer_id)

    def _uneven(self, recorded):
        """Whether a DTensor's shards over a model axis differ in size."""
        if recorded is None:
            return False
        placements, shape = recorded
        return not even_shards(
            shape, self.run_spec.mesh, placements, skip=self.run_spec.dim
        )

    def note_reshape(self, x, out):
        """Notes a reshape's input and result in the DTensor run."""
        if not self.inside:
            self.reshapes.append((spec(x), spec(out)))

    def note_slice_update(self, inputs, out):
        """Notes a `slice_update`'s updated tensor and result."""
        if not self.inside:
            self.slice_updates.append((spec(inputs), spec(out)))

    def set_outputs(self, outputs):
        self.outputs = tuple(spec(x) for x in fast_tree.flatten(outputs))


@contextlib.contextmanager
def recording(record):
    """A context in which layer calls are noted in `record`."""
    token = _RECORDING.set(record)
    try:
        yield record
    finally:
        _RECORDING.reset(token)


def recorder():
    """The `Record` of the DTensor run in progress, or None."""
    return _RECORDING.get()


def fingerprint(outputs):
    """This rank's share of each output tensor, summed two ways: equal
    for equal tensors (enough to find the layer where runs part)."""
    out = []
    for x in fast_tree.flatten(outputs):
        if isinstance(x, torch.Tensor):
            local = x.to_local() if isinstance(x, DTensor) else x
            local = local.detach().double()
            out.append(
                (
                    tuple(local.shape),
                    local.sum().item(),
                    local.abs().sum().item(),
                )
            )
    return tuple(out)
