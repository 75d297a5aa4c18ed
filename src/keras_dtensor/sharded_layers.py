"""Model-sharded layers as DTensor islands in a call on local tensors.

torch's tensor parallelism (`ColwiseParallel`, `RowwiseParallel`) keeps
DTensors only inside the sharded modules: their inputs become DTensors at
the module's boundary, their outputs leave as local tensors, and every op
between them (attention's core, norms, residual adds, activations) runs on
plain tensors without DTensor's per-op dispatch. The same here, for a model
on the local path (`local_batch`) whose layout shards weights over an axis
other than the batch axis:

- a *boundary* layer is one that owns such a weight directly (a `Dense`
  or `EinsumDense` split by columns or rows, a sharded embedding), or owns
  a replicated weight and is given sharded inputs (a norm over heads);
  it runs as DTensors, its weights untouched, its inputs made DTensors
  with the placements they had in a DTensor run of the same call, its
  outputs reduced (`Partial` -> `Replicate`, one all-reduce, like
  `RowwiseParallel`) and handed on as local tensors;
- everything else runs on local tensors.

A plain tensor does not say how it is laid out, and a Keras layer's code
is arbitrary: a reshape to a global head count, or a softmax over a
sharded dim, would run on the shard and be silently wrong. So nothing is
assumed. The first call with a new input signature (shapes, dtypes,
placements, flags) runs twice: as DTensors without autograd, with every
boundary layer's input placements recorded (`Record`), then on local
tensors with those placements (`Replay`). The local run is kept only if it
raised nothing and each output equals the DTensor run's bit for bit, on
every rank (one all-reduce of the verdicts). When it is not:

- a layer whose call raised (a reshape to a global size) joins the
  boundary, and the check runs again;
- outputs that differ, or an error at a boundary layer's input, make the
  check run again with every layer's outputs fingerprinted in both runs:
  the first layer whose outputs differ (a softmax over a sharded dim, in
  keras_hub's MoE router) joins the boundary;
- when the cause is in the model's own call, or after `_MAX_PROMOTED`
  layers, the signature runs as DTensors, and rank 0 says why, once per
  distribution.

Each check costs up to three forward passes, once per model and signature.
"""

import contextlib
import contextvars
import dataclasses
import re
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor import callbacks
from keras_dtensor import context
from keras_dtensor.errors import AssignedInCall

__all__ = [
    "Record",
    "Replay",
    "State",
    "agree",
    "boundary_call",
    "call",
    "checked_call",
    "current_replay",
    "failed_in",
    "matches",
    "outputs_global",
    "recorder",
    "reason",
    "recording",
    "replaying",
    "signature",
]

# On a model: `(plan, {signature: Record or None}, State)`.
_RECORDS = "_keras_dtensor_sharded_records"
_MISSING = object()
_SAID = "_keras_dtensor_said_runs_as_dtensors"
# Layers promoted to the boundary, one per failed local run, at most.
_MAX_PROMOTED = 8
_RECORDING = contextvars.ContextVar("keras_dtensor_recording", default=None)
_REPLAY = contextvars.ContextVar("keras_dtensor_replay", default=None)


class Mismatch(Exception):  # noqa: N818 (a signal, not an error)
    """The local run reached a layer call the DTensor run did not make."""


def _spec(x):
    """A DTensor leaf's `(placements, global shape)`; None for others."""
    if isinstance(x, DTensor):
        return tuple(x.placements), tuple(x.shape)
    return None


def signature(flat):
    """What decides a call's control flow and shapes: each tensor's shape,
    dtype and placements, and every simple argument (`training=True`)."""
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, _spec(x)))
        elif x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            out.append(type(x).__name__)
    return tuple(out)


@dataclasses.dataclass
class Record:
    """A DTensor run's boundary calls: `calls[(id(layer), n)]` holds the
    input and output specs of the layer's n-th call; `outputs` the specs of
    the model's outputs; `boundary` the layers that run as DTensors."""

    boundary: set
    plan: object
    calls: dict = dataclasses.field(default_factory=dict)
    outputs: tuple = ()
    counts: dict = dataclasses.field(default_factory=dict)
    weights: dict = dataclasses.field(default_factory=dict)
    # `{(id(layer), n): fingerprint of its outputs}` of every layer call,
    # when a local run that differed is being traced to its layer.
    fingerprints: dict | None = None

    def enter(self, layer, args, kwargs):
        """Notes a nested layer call of the DTensor run; returns its key.
        Layers with weights get their inputs' layouts noted: a replicated
        weight given sharded inputs joins the boundary (its gradient is a
        sum over the shards, which only the DTensor run makes)."""
        key = (id(layer), self.counts.get(id(layer), 0))
        self.counts[id(layer)] = key[1] + 1
        if not (
            id(layer) in self.boundary
            or layer.__dict__.get("_trainable_variables")
            or layer.__dict__.get("_non_trainable_variables")
        ):
            return key
        from keras.src import tree

        inputs = tuple(_spec(x) for x in tree.flatten((args, kwargs)))
        if id(layer) not in self.boundary and not all(
            spec is None or self.plan.whole(spec[0]) for spec in inputs
        ):
            self.boundary.add(id(layer))
        self.calls[key] = inputs
        self.weights[id(layer)] = tuple(layer.weights)
        return key

    def leave(self, key, outputs):
        if self.fingerprints is not None:
            self.fingerprints[key] = _fingerprint(outputs)

    def set_outputs(self, outputs):
        from keras.src import tree

        self.outputs = tuple(_spec(x) for x in tree.flatten(outputs))


@contextlib.contextmanager
def recording(record):
    token = _RECORDING.set(record)
    try:
        yield record
    finally:
        _RECORDING.reset(token)


def recorder():
    """The `Record` of the DTensor run in progress, or None."""
    return _RECORDING.get()


@dataclasses.dataclass
class Replay:
    """A local run following `record`; `originals[id(variable)]` is each
    weight's DTensor (the local run reads most weights as local tensors)."""

    record: Record
    originals: dict
    mesh: object
    counts: dict = dataclasses.field(default_factory=dict)
    # The innermost layer whose call raised, if one did.
    culprit: object = None
    # id(local tensor) -> (local tensor, its DTensor): one tensor given to
    # several boundary layers (the query, key and value projections) is
    # wrapped once, so their gradients add up as one pending sum and are
    # reduced once (torch's `PrepareModuleInput` on the attention block).
    wrapped: dict = dataclasses.field(default_factory=dict)

    def to_dtensor(self, x, spec):
        if spec is None or not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, DTensor):
            return x
        known = self.wrapped.get(id(x))
        if known is not None and known[0] is x:
            if known[1].placements == spec[0]:
                return known[1]
        out = _to_dtensor(x, spec, self.mesh)
        self.wrapped[id(x)] = (x, out)
        return out


@contextlib.contextmanager
def replaying(replay):
    token = _REPLAY.set(replay)
    try:
        yield replay
    finally:
        _REPLAY.reset(token)


def _fingerprint(outputs):
    """This rank's share of each output tensor, summed two ways: equal
    for equal tensors (enough to find the layer where runs part)."""
    from keras.src import tree

    out = []
    for x in tree.flatten(outputs):
        if isinstance(x, torch.Tensor):
            local = _local(x).detach().double()
            out.append(
                (
                    tuple(local.shape),
                    local.sum().item(),
                    local.abs().sum().item(),
                )
            )
    return tuple(out)


def current_replay():
    """The `Replay` of the local run in progress, or None."""
    return _REPLAY.get()


def checked_call(replay, layer, original, args, kwargs):
    """A layer call of a local run being traced: its outputs must have
    the fingerprint the DTensor run's had, else this layer is where the
    runs part."""
    key = (id(layer), replay.counts.get(id(layer), 0))
    replay.counts[id(layer)] = key[1] + 1
    outputs = original(layer, *args, **kwargs)
    if _fingerprint(outputs) != replay.record.fingerprints.get(key):
        failed_in(layer)
        raise Mismatch(f"{layer.name!r}: its outputs differ")
    return outputs


def failed_in(layer):
    """Notes the innermost layer whose call raised during a local run."""
    replay = _REPLAY.get()
    if replay is not None and replay.culprit is None:
        replay.culprit = layer


def _to_dtensor(x, spec, mesh):
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    placements, shape = spec
    # The global stride follows the local one (an attention output is a
    # transposed view); the shape must come out as recorded (even shards).
    out = DTensor.from_local(x, mesh, placements, run_check=False)
    if tuple(out.shape) != shape:
        raise Mismatch(
            f"an input of local shape {tuple(x.shape)}, where the DTensor "
            f"run had {shape} as {placements}"
        )
    return out


def _reduced(x):
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        placements = [
            Replicate() if p.is_partial() else p for p in x.placements
        ]
        return x.redistribute(x.device_mesh, placements)
    return x


def boundary_call(replay, layer, original, args, kwargs, dtensor_scope):
    """Runs a boundary layer as DTensors inside a local run: inputs laid
    out as in the recorded DTensor run, the layer's own weights read as
    their DTensors, outputs reduced and returned as local tensors."""
    from keras.src import tree

    key = (id(layer), replay.counts.get(id(layer), 0))
    replay.counts[id(layer)] = key[1] + 1
    recorded = replay.record.calls.get(key)
    flat = tree.flatten((args, kwargs))
    if recorded is None or len(recorded) != len(flat):
        raise Mismatch(f"{layer.name!r}: a call the DTensor run did not make")
    try:
        flat = [
            replay.to_dtensor(x, spec)
            for x, spec in zip(flat, recorded, strict=True)
        ]
    except Mismatch as error:
        raise Mismatch(f"{layer.name!r}: {error}") from None
    args, kwargs = tree.pack_sequence_as((args, kwargs), flat)
    own = replay.record.weights[id(layer)]
    saved = [(variable, variable._value) for variable in own]
    try:
        for variable in own:
            value = replay.originals.get(id(variable))
            if value is not None:
                variable._value = value
        with dtensor_scope():
            outputs = original(layer, *args, **kwargs)
    finally:
        for variable, value in saved:
            variable._value = value

    def to_local(x):
        x = _reduced(x)
        if not isinstance(x, DTensor):
            return x
        return x.to_local(grad_placements=tuple(x.placements))

    return tree.map_structure(to_local, outputs)


def matches(reference, local):
    """Whether the local run's outputs are this rank's shards of the
    DTensor run's, bit for bit; `(ok, reason)`."""
    from keras.src import tree

    flat_ref = tree.flatten(reference)
    flat_local = tree.flatten(local)
    if len(flat_ref) != len(flat_local):
        return False, "the outputs differ in structure"
    for ref, out in zip(flat_ref, flat_local, strict=True):
        if not isinstance(ref, torch.Tensor):
            continue
        if not isinstance(ref, DTensor) or isinstance(out, DTensor):
            return False, "an output is not a DTensor in the DTensor run"
        shard = ref.to_local()
        if shard.shape != out.shape or shard.dtype != out.dtype:
            return False, (
                f"an output's local shape {tuple(out.shape)} is not the "
                f"shard's {tuple(shard.shape)}"
            )
        if not torch.equal(shard.detach(), out.detach()):
            diff = (shard.detach().double() - out.detach().double()).abs()
            return False, (
                "an output's values differ from the DTensor run's (by up "
                f"to {diff.max().item():.3g})"
            )
    return True, ""


def reason(error):
    """One line saying why a local run failed, without the frame Keras
    wraps around an error raised in a layer's call."""
    text = str(error)
    if "\n\n" in text:  # "Exception encountered when calling ...\n\n"
        text = text.split("\n\n")[1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}"


def outputs_global(record, mesh, outputs):
    """The local run's outputs as the DTensors the DTensor run returned."""
    from keras.src import tree

    flat = tree.flatten(outputs)
    if len(flat) != len(record.outputs):
        raise Mismatch("the outputs differ in structure")
    flat = [
        _to_dtensor(x, spec, mesh)
        for x, spec in zip(flat, record.outputs, strict=True)
    ]
    return tree.pack_sequence_as(outputs, flat)


def agree(code, mesh):
    """The lowest and highest of every rank's verdict (an int): one
    all-reduce of `[code, -code]` (MIN)."""
    both = torch.tensor([code, -code], device=mesh.device_type)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
    low, high = both.tolist()
    return low, -high


@dataclasses.dataclass
class State:
    """A model's layers promoted to the boundary (ids)."""

    promoted: set = dataclasses.field(default_factory=set)


def _records(layer, plan_):
    cached = layer.__dict__.get(_RECORDS)
    if cached is None or cached[0] is not plan_:
        cached = layer.__dict__[_RECORDS] = (plan_, {}, State())
    return cached[1], cached[2]


def call(layer, plan_, flat, reference, run):
    """A model's call with its tensor-parallel layers as DTensor islands.

    `flat`: the call's inputs, flattened; `reference()` runs the call as
    DTensors; `run(replay)` runs it on local tensors following `replay`.
    Returns `(True, outputs)`, or `(False, None)`: run it as DTensors.

    A signature's first call checks the local run against the DTensor run
    (see the module's docstring). A layer whose call raises in the local
    run (a reshape to a global head count: keras_hub's Gemma attention) is
    made a boundary layer and the check runs again, up to `_MAX_PROMOTED`
    times: the layer then runs as DTensors, the rest still locally.
    """
    if any(isinstance(x, torch.Tensor) and _local(x).is_meta for x in flat):
        return False, None  # Keras's shape inference: nothing to compare
    records, state = _records(layer, plan_)
    key = signature(flat)
    record = records.get(key, _MISSING)
    if record is None:  # checked: this signature runs as DTensors
        return False, None
    if record is not _MISSING:
        outputs = run(_replay(record, plan_))
        return True, outputs_global(record, plan_.mesh, outputs)
    order = {id(sub): i for i, sub in enumerate(plan_.layers)}
    ok, trace = len(order), len(order) + 1
    tracing = False
    while True:
        # The DTensor run to compare with: no autograd (no second graph
        # of activations), stopped before any variable is written.
        record = Record(set(plan_.boundary) | state.promoted, plan_)
        if tracing:
            record.fingerprints = {}
        try:
            with torch.no_grad(), recording(record):
                expected = reference()
        except AssignedInCall:
            records[key] = None
            return False, None
        record.set_outputs(expected)
        code, outputs, why = -1, None, None
        replay = _replay(record, plan_)
        try:
            outputs = run(replay)
            same, why = matches(expected, outputs)
            code = ok if same else (-1 if tracing else trace)
            adding = _adds_local_loss(plan_.layers)
            if same and adding is not None:
                # A loss must be a global value (an MoE's auxiliary loss):
                # the layer adding it runs as DTensors, as it did here.
                why = f"{adding.name!r} adds a loss in its call"
                code = -1
                if adding is not layer and id(adding) not in record.boundary:
                    if len(state.promoted) < _MAX_PROMOTED:
                        code = order[id(adding)]
        except AssignedInCall:
            why = "a layer assigns a variable in its call"
        except Exception as error:  # noqa: BLE001 (any: DTensors)
            why = reason(error)
            culprit = replay.culprit
            if (
                culprit is not None
                and id(culprit) in order
                and culprit is not layer
                and id(culprit) not in record.boundary
                and len(state.promoted) < _MAX_PROMOTED
            ):
                code = order[id(culprit)]
            elif not tracing:
                # Raised at the boundary (an input laid out otherwise
                # than in the DTensor run): the cause is upstream.
                code = trace
        low, high = agree(code, plan_.mesh)
        if low == high == ok:
            record.fingerprints = None  # later calls are not traced
            records[key] = record
            return True, outputs_global(record, plan_.mesh, outputs)
        if low >= ok and high == trace:
            # Some rank's outputs differ: once more, tracing each layer's
            # outputs to find the one where the runs part.
            tracing = True
            continue
        if low != high or low < 0 or low >= ok:
            break
        state.promoted.add(id(plan_.layers[low]))
    records[key] = None
    # Said once per distribution: keras_hub's generate calls each decoder
    # block on its own, and each would say the same.
    distribution = context.active()
    said = distribution is None or distribution.__dict__.get(_SAID, False)
    if not said and not callbacks.silent():
        warnings.warn(
            f"keras-dtensor: {layer.name!r} runs as DTensors between its "
            "tensor-parallel layers, not on local tensors: its local run "
            "did not give the DTensor run's outputs on every rank"
            + (f" (rank 0: {why})" if why else "")
            + f". Mesh {plan_.mesh}.",
            stacklevel=4,
        )
    if distribution is not None:
        distribution.__dict__[_SAID] = True
    return False, None


def _adds_local_loss(layers):
    """The first layer holding a loss that is a plain tensor (one rank's
    share, from a local run), or None."""
    for sub in layers:
        for loss in sub._losses:
            if isinstance(loss, torch.Tensor) and not isinstance(loss, DTensor):
                return sub
    return None


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def _replay(record, plan_):
    originals = {id(v): v._value for v, _, _ in plan_.weights}
    return Replay(record, originals, plan_.mesh)
