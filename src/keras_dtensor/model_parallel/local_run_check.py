"""Whether a model's local run between tensor-parallel layers is exact.

Each input signature's first call runs as DTensors (recorded), then
locally, kept only if its outputs equal the DTensor run's bit for bit on
every rank (one all-reduce agrees); else a layer joins the boundary and
the check runs again, or the signature runs as DTensors.
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
from keras_dtensor.model_parallel import boundary_layers
from keras_dtensor.model_parallel import local_run_spec
from keras_dtensor.model_parallel import reference_run

__all__ = ["State", "agree", "call", "matches", "reason", "signature"]

# On a model: `(run_spec, {signature: Record or None}, {layouts: State})`.
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
            out.append((tuple(x.shape), x.dtype, reference_run.spec(x)))
        elif x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            out.append(type(x).__name__)
    return tuple(out)


def matches(reference, local, final):
    """`(ok, reason)`: whether `final` (the local outputs as DTensors) are
    this rank's shards of the DTensor run's, bit for bit."""
    flats = [fast_tree.flatten(x) for x in (reference, local, final)]
    for ref, out, made in zip(*flats, strict=True):
        if not isinstance(ref, torch.Tensor):
            continue
        if not isinstance(ref, DTensor) or isinstance(out, DTensor):
            return False, "an output is not a DTensor in the DTensor run"
        out, shard = made.to_local().detach(), ref.to_local().detach()
        if shard.shape != out.shape or shard.dtype != out.dtype:
            return False, (
                f"an output's local shape {tuple(out.shape)} is not the "
                f"shard's {tuple(shard.shape)}"
            )
        if not torch.equal(shard, out):
            diff = (shard.double() - out.double()).abs()
            return False, (
                "an output's values differ from the DTensor run's (by up "
                f"to {diff.max().item():.3g})"
            )
    return True, ""


def reason(error):
    """Why a local run failed, in one line, without Keras's frame."""
    text = str(error)
    if "\n\n" in text:  # "Exception encountered when calling ...\n\n"
        text = text.split("\n\n")[1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def agree(code, mesh):
    """The lowest and highest verdict of all ranks (one all-reduce)."""
    both = torch.tensor([code, -code], device=mesh.device_type)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
    low, high = both.tolist()
    return low, -high


@dataclasses.dataclass
class State:
    """Ids of a model's layers promoted to the boundary, and of its boundary
    layers whose outputs leave replicated, for one layout of its inputs."""

    promoted: set = dataclasses.field(default_factory=set)
    replicated: set = dataclasses.field(default_factory=set)


def call(layer, run_spec, flat, reference, run):
    """A model's call with its tensor-parallel layers as DTensor islands:
    `(True, outputs)`, or `(False, None)` to run as DTensors. `reference()`
    runs the call as DTensors, `run(replay)` locally following `replay`.
    All ranks take each decision together (`agree`)."""
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
        return False, None  # Keras's shape inference: nothing to compare
    cached = object_state.get_on(layer, _RECORDS)
    if cached is None or cached[0] is not run_spec:
        cached = object_state.set_on(layer, _RECORDS, (run_spec, {}, {}))
    records, states = cached[1], cached[2]
    key = signature(flat)
    record = records.get(key, _MISSING)
    if record is None:  # checked: this signature runs as DTensors
        return False, None
    if record is not _MISSING:
        outputs = run(boundary_layers.Replay(record, run_spec.mesh))
        return True, boundary_layers.outputs_global(
            record, run_spec.mesh, outputs
        )
    # The layers promoted depend on the placements of the inputs too.
    layouts = tuple(
        tuple(x.placements) if isinstance(x, DTensor) else None for x in flat
    )
    state = states.setdefault(layouts, State())
    promoted, replicated = state.promoted, state.replicated
    order = {id(sub): i for i, sub in enumerate(run_spec.layers)}
    # Verdicts: a layer's index (promote it), `ok`, `trace` (trace the
    # layers' outputs to find where the runs part) or -1 (no layer).
    ok, trace = len(order), len(order) + 1
    tracing = False
    children = frozenset(
        id(sub)
        for sub in layer._flatten_layers(include_self=False, recursive=False)
    )

    def blame(sub, default=-1):
        """The verdict promoting `sub`, where it may be promoted."""
        if (
            sub is None
            or id(sub) not in order
            or sub is layer
            or id(sub) in record.boundary
            or len(promoted) >= _MAX_PROMOTED
        ):
            return default
        return order[id(sub)]

    # Layers made to hand on whole outputs, and the first failure's reason.
    tried, first_why = [], None
    while True:
        record = reference_run.Record(
            set(run_spec.boundary) | promoted,
            run_spec,
            children=children,
            replicated=frozenset(replicated),
        )
        if tracing:
            record.fingerprints = {}
        try:
            with torch.no_grad(), reference_run.recording(record):
                expected = reference()
        except AssignedInCall:
            records[key] = None
            return False, None
        flat_out = fast_tree.flatten(expected)
        record.outputs = tuple(reference_run.spec(x) for x in flat_out)
        if not record.between:
            # Nothing to run locally, for any signature, until a new weight.
            records[key] = None
            local_run_spec.forget(layer)
            return False, None
        if record.uneven:
            # Decided from the DTensor run alone, the same on every rank.
            more = record.uneven - record.boundary
            if None in more or len(promoted | more) > _MAX_PROMOTED:
                records[key] = None
                return False, None
            if more:
                promoted |= more
                continue
        code, outputs, why = -1, None, None
        replay = boundary_layers.Replay(record, run_spec.mesh)
        default = -1 if tracing else trace
        try:
            outputs = run(replay)
            final = boundary_layers.outputs_global(
                record, run_spec.mesh, outputs
            )
            same, why = matches(expected, outputs, final)
            code = ok if same else default
            if replay.values_differ:  # traced to a layer on this rank
                same = False
                why = f"{replay.culprit.name!r}: its outputs differ"
                code = blame(replay.culprit)
            adding = local_run_spec.adding_losses(run_spec.layers)
            if same and adding:
                # A loss must be a global value: its layer runs as DTensors.
                why = f"{adding[0].name!r} adds a loss in its call"
                code = blame(adding[0])
        except AssignedInCall:
            why = "a layer assigns a variable in its call"
        except Exception as error:  # noqa: BLE001 (any: DTensors)
            why = reason(error)
            # Raised at a boundary layer's input: the cause is upstream.
            code = blame(replay.culprit, default)
        low, high = agree(code, run_spec.mesh)
        if low == high == ok:
            record.fingerprints = None  # later calls are not traced
            records[key] = record
            return True, final
        if low >= ok and high == trace:
            tracing = True
            continue
        if low == high == -1 and tracing:
            # No layer at fault: the model's own ops. Its next boundary layer
            # with sharded outputs hands them on whole (the same on all ranks).
            untried = [i for i in record.sharded_outputs if i not in replicated]
            if untried and len(replicated) < _MAX_PROMOTED:
                first_why = why if first_why is None else first_why
                tried.append(untried[0])
                replicated.add(untried[0])
                tracing = False
                continue
        if low != high or low < 0 or low >= ok:
            break
        promoted.add(id(run_spec.layers[low]))
    records[key] = None
    if tried:  # no help: said with the first reason
        replicated.difference_update(tried)
        why = first_why
    distribution = context.active()
    if distribution is None or object_state.get_on(distribution, _SAID):
        return False, None
    object_state.set_on(distribution, _SAID, True)
    if not console.silent():
        warnings.warn(
            f"keras-dtensor: {layer.name!r} runs as DTensors between its "
            "tensor-parallel layers, not on local tensors: its local run "
            "did not give the DTensor run's outputs on every rank"
            + (f" (rank 0: {why})" if why else "")
            + f". Mesh {run_spec.mesh}.",
            stacklevel=4,
        )
    return False, None
