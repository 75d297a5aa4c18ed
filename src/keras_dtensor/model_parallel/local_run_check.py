"""Whether a model's local run between tensor-parallel layers is exact.

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
- when the cause is in the model's own call, the model's own boundary
  layers whose outputs are sharded are made to hand them on replicated,
  one at a time in call order (a hidden-split embedding's output, added
  to a whole tensor by the model's own residual add), and the check runs
  again;
- when that does not help either, or after `_MAX_PROMOTED` layers, the
  signature runs as DTensors, and rank 0 says why, once per
  distribution.

A model whose every layer call is a boundary one (a stack of split
`Dense` layers) has nothing to run locally; it runs as DTensors, which
spares the conversions at each boundary (a measurable part of the MLP's
step on CPU processes).

Each attempt costs two forward passes (the DTensor one without autograd);
a model with n layers to move takes about n + 2 attempts, once per model
and signature; later calls of the signature run once, locally.
"""

import dataclasses
import re
import warnings

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor.backend import console
from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.errors import AssignedInCall
from keras_dtensor.model_parallel import local_run_spec
from keras_dtensor.model_parallel.boundary_layers import Replay
from keras_dtensor.model_parallel.boundary_layers import outputs_global
from keras_dtensor.model_parallel.reference_run import Record
from keras_dtensor.model_parallel.reference_run import recording
from keras_dtensor.model_parallel.reference_run import spec

__all__ = ["State", "agree", "call", "matches", "reason", "signature"]

# On a model: `(run_spec, {signature: Record or None}, State)`.
_RECORDS = "_keras_dtensor_sharded_records"
_MISSING = object()
_SAID = "_keras_dtensor_said_runs_as_dtensors"
# Layers promoted to the boundary, one per failed local run, at most.
_MAX_PROMOTED = 8


def signature(flat):
    """What decides a call's control flow and shapes: each tensor's shape,
    dtype and placements, and every simple argument (`training=True`)."""
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, spec(x)))
        elif x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            out.append(type(x).__name__)
    return tuple(out)


def matches(reference, local, final=None):
    """Whether the local run's outputs are this rank's shards of the
    DTensor run's, bit for bit; `(ok, reason)`. `final`: the local
    outputs as the DTensors the call returns (`outputs_global`), if they
    were made: their shards are the ones compared."""
    flat_ref = fast_tree.flatten(reference)
    flat_local = fast_tree.flatten(local)
    flat_final = flat_local if final is None else fast_tree.flatten(final)
    if not len(flat_ref) == len(flat_local) == len(flat_final):
        return False, "the outputs differ in structure"
    for ref, out, made in zip(flat_ref, flat_local, flat_final, strict=True):
        if not isinstance(ref, torch.Tensor):
            continue
        if not isinstance(ref, DTensor) or isinstance(out, DTensor):
            return False, "an output is not a DTensor in the DTensor run"
        if final is not None:
            out = made.to_local()
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


def _culprit_code(replay, order, layer, record, state, default):
    """The verdict naming the layer where the runs parted, if it may be
    promoted to the boundary; else `default`."""
    culprit = replay.culprit
    if (
        culprit is not None
        and id(culprit) in order
        and culprit is not layer
        and id(culprit) not in record.boundary
        and len(state.promoted) < _MAX_PROMOTED
    ):
        return order[id(culprit)]
    return default


def agree(code, mesh):
    """The lowest and highest of every rank's verdict (an int): one
    all-reduce of `[code, -code]` (MIN)."""
    both = torch.tensor([code, -code], device=mesh.device_type)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
    low, high = both.tolist()
    return low, -high


@dataclasses.dataclass
class State:
    """A model's layers promoted to the boundary, and its boundary layers
    whose outputs leave replicated (ids), for one layout of its inputs."""

    promoted: set = dataclasses.field(default_factory=set)
    replicated: set = dataclasses.field(default_factory=set)


def layouts(flat):
    """The placements of a call's DTensor inputs: what the layers promoted
    for one call depend on. keras_hub's first cached call gets a
    replicated cache (`ops.zeros`), which its attention cannot take
    locally; the decoding calls after it get the cache sharded by heads,
    which it can."""
    return tuple(
        tuple(x.placements) if isinstance(x, DTensor) else None for x in flat
    )


def _records(layer, run_spec):
    """`(records by signature, States by input layout)`."""
    cached = object_state.get_on(layer, _RECORDS)
    if cached is None or cached[0] is not run_spec:
        cached = object_state.set_on(layer, _RECORDS, (run_spec, {}, {}))
    return cached[1], cached[2]


def call(layer, run_spec, flat, reference, run):
    """A model's call with its tensor-parallel layers as DTensor islands.

    `flat`: the call's inputs, flattened; `reference()` runs the call as
    DTensors; `run(replay)` runs it on local tensors following `replay`.
    Returns `(True, outputs)`, or `(False, None)`: run it as DTensors.

    A signature's first call checks the local run against the DTensor run
    (see the module's docstring); a layer found at fault is made a
    boundary layer and the check runs again, up to `_MAX_PROMOTED` layers
    per model: those layers then run as DTensors, the rest locally. All
    ranks take each decision together (`agree`).
    """
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
        return False, None  # Keras's shape inference: nothing to compare
    records, states = _records(layer, run_spec)
    key = signature(flat)
    record = records.get(key, _MISSING)
    if record is None:  # checked: this signature runs as DTensors
        return False, None
    if record is not _MISSING:
        outputs = run(_replay(record, run_spec))
        return True, outputs_global(record, run_spec.mesh, outputs)
    state = states.setdefault(layouts(flat), State())
    order = {id(sub): i for i, sub in enumerate(run_spec.layers)}
    ok, trace = len(order), len(order) + 1
    tracing = False
    children = frozenset(
        id(sub)
        for sub in layer._flatten_layers(include_self=False, recursive=False)
    )
    # Layers made to hand on whole outputs by this check, and why the
    # model's own call failed before the first of them.
    tried, first_why = [], None
    while True:
        # The DTensor run to compare with: no autograd (no second graph
        # of activations), stopped before any variable is written.
        record = Record(
            set(run_spec.boundary) | state.promoted,
            run_spec,
            children=children,
            replicated=frozenset(state.replicated),
        )
        if tracing:
            record.fingerprints = {}
        try:
            with torch.no_grad(), recording(record):
                expected = reference()
        except AssignedInCall:
            records[key] = None
            return False, None
        record.set_outputs(expected)
        if not record.between:
            # Every layer is a boundary layer: nothing to run locally, for
            # any signature; the model stops asking (until LoRA or another
            # new weight changes it).
            records[key] = None
            local_run_spec.forget(layer)
            return False, None
        if record.uneven:
            # Decided from the DTensor run alone (the same on every rank):
            # a layer meeting shards of different sizes runs as DTensors.
            more = record.uneven - record.boundary
            if None in more or len(state.promoted | more) > _MAX_PROMOTED:
                records[key] = None
                return False, None
            if more:
                state.promoted |= more
                continue
        code, outputs, why = -1, None, None
        replay = _replay(record, run_spec)
        try:
            outputs = run(replay)
            final = outputs_global(record, run_spec.mesh, outputs)
            same, why = matches(expected, outputs, final)
            code = ok if same else (-1 if tracing else trace)
            if replay.values_differ:  # traced to a layer on this rank
                same, why = (
                    False,
                    f"{replay.culprit.name!r}: its outputs differ",
                )
                code = _culprit_code(replay, order, layer, record, state, -1)
            adding = _adds_local_loss(run_spec.layers)
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
            # Raised at the boundary (an input laid out otherwise than in
            # the DTensor run): the cause is upstream.
            default = -1 if tracing else trace
            code = _culprit_code(replay, order, layer, record, state, default)
        low, high = agree(code, run_spec.mesh)
        if low == high == ok:
            record.fingerprints = None  # later calls are not traced
            records[key] = record
            return True, final
        if low >= ok and high == trace:
            # Some rank's outputs differ: once more, tracing each layer's
            # outputs to find the one where the runs part.
            tracing = True
            continue
        if low == high == -1 and tracing:
            # No layer at fault: the model's own ops. The next of its own
            # boundary layers with sharded outputs hands them on whole.
            # (The same record on every rank: the same choice.)
            untried = [
                i for i in record.sharded_outputs if i not in state.replicated
            ]
            if untried and len(state.replicated) < _MAX_PROMOTED:
                first_why = why if first_why is None else first_why
                tried.append(untried[0])
                state.replicated.add(untried[0])
                tracing = False
                continue
        if low != high or low < 0 or low >= ok:
            break
        state.promoted.add(id(run_spec.layers[low]))
    records[key] = None
    if tried:  # no help: said with the first reason
        state.replicated.difference_update(tried)
        why = first_why
    # Said once per distribution: keras_hub's generate calls each decoder
    # block on its own, and each would say the same.
    distribution = context.active()
    said = distribution is None or object_state.get_on(
        distribution, _SAID, False
    )
    if not said and not console.silent():
        warnings.warn(
            f"keras-dtensor: {layer.name!r} runs as DTensors between its "
            "tensor-parallel layers, not on local tensors: its local run "
            "did not give the DTensor run's outputs on every rank"
            + (f" (rank 0: {why})" if why else "")
            + f". Mesh {run_spec.mesh}.",
            stacklevel=4,
        )
    if distribution is not None:
        object_state.set_on(distribution, _SAID, True)
    return False, None


def _adds_local_loss(layers):
    """The first layer holding a loss that is a plain tensor (one rank's
    share, from a local run), or None."""
    for sub in layers:
        for loss in sub._losses:
            if isinstance(loss, torch.Tensor) and not isinstance(loss, DTensor):
                return sub
    return None


def _replay(record, run_spec):
    return Replay(record, run_spec.mesh)
