"""Model-sharded layers as DTensor islands in a call on local tensors.

torch's tensor parallelism (`ColwiseParallel`, `RowwiseParallel`) keeps
DTensors only inside the sharded modules: their inputs become DTensors at
the module's boundary, their outputs leave as local tensors, and every op
between them (attention's core, norms, residual adds, activations) runs on
plain tensors without DTensor's per-op dispatch. The same here, for a model
on the local path (`local_run`) whose layout shards weights over an axis
other than the batch axis:

- a *boundary* layer is one that owns such a weight directly (a `Dense`
  or `EinsumDense` split by columns or rows, a sharded embedding), or owns
  a replicated weight and is given sharded inputs (a norm over heads);
  it runs as DTensors, its weights untouched, its inputs made DTensors
  with the placements they had in a DTensor run of the same call, its
  outputs reduced (`Partial` -> `Replicate`, one all-reduce, like
  `RowwiseParallel`) and handed on as local tensors;
- everything else runs on local tensors;
- where a model's own ops meet a boundary layer's sharded output with a
  whole tensor (a hidden-split embedding's output in a residual add),
  that layer's output leaves replicated (one all-gather, torch's
  `output_layouts=Replicate()`), and the next boundary layer cuts it to
  the shards it had in the DTensor run.

Which layers are the boundary, and whether a model's local run gives
the DTensor run's numbers, is decided by `local_run_check`.
"""

import contextlib
import contextvars
import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor.backend import fast_tree
from keras_dtensor.model_parallel import local_split
from keras_dtensor.model_parallel.reference_run import fingerprint

__all__ = [
    "Mismatch",
    "Replay",
    "boundary_call",
    "checked_call",
    "current_replay",
    "failed_in",
    "outputs_global",
    "reduce_partial",
    "replaying",
]

_REPLAY = contextvars.ContextVar("keras_dtensor_replay", default=None)


class Mismatch(Exception):  # noqa: N818 (a signal, not an error)
    """The local run parted from the DTensor run: a call it did not make,
    an input laid out otherwise, or outputs that differ."""


@contextlib.contextmanager
def _set(var, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


@dataclasses.dataclass
class Replay:
    """A local run following `record` (the boundary layers' weights stay
    DTensors in it: `Record.kept`)."""

    record: object  # its `record.Record`
    mesh: object
    counts: dict = dataclasses.field(default_factory=dict)
    # The innermost layer whose call raised, if one did.
    culprit: object = None
    values_differ: bool = False  # a traced layer's values differed here
    # `(local tensor, its DTensor)` of the last input wrapped: one tensor
    # given to consecutive boundary layers (the query, key and value
    # projections) is wrapped once, so their gradients add up as one
    # partial sum, reduced once (torch's `PrepareModuleInput` on an
    # attention block). One slot: earlier inputs are not kept alive.
    wrapped: tuple = (None, None)
    # The same for an input of layers run on their shards (`local_split`):
    # `(local tensor, it through copy_in, the axes)`.
    copied: tuple = (None, None, None)
    reshaped: int = 0  # reshapes run so far, outside boundary layers
    sliced: int = 0  # and slice_updates

    def to_dtensor(self, x, recorded):
        if recorded is None or not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, DTensor):
            return x
        last, out = self.wrapped
        if last is x and out.placements == recorded[0]:
            return out
        out = _to_dtensor(x, recorded, self.mesh, self.record.run_spec.dim)
        self.wrapped = (x, out)
        return out


def replaying(replay):
    """A context in which layer calls follow `replay`."""
    return _set(_REPLAY, replay)


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
    expected, specs = replay.record.fingerprints.get(key, (None, ()))
    flat = fast_tree.flatten(outputs)
    if len(specs) == len(flat):
        # An output handed on whole (`Record.replicated`) is compared by
        # the shard the DTensor run had.
        flat = [
            _as_shard(x, s, replay) for x, s in zip(flat, specs, strict=True)
        ]
    got = fingerprint(flat)
    if got != expected:
        failed_in(layer)
        shapes = [f[0] for f in got]
        if expected is None or shapes != [f[0] for f in expected]:
            raise Mismatch(f"{layer.name!r}: its outputs differ")
        # Values only, and maybe on this rank only: raising here would
        # leave the other ranks in the run's next collective. The run goes
        # on; the verdict is agreed once it ends (`local_run_check`).
        replay.values_differ = True
    return outputs


def _as_shard(x, recorded, replay):
    if recorded is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        return x
    try:
        out = _to_dtensor(x, recorded, replay.mesh, replay.record.run_spec.dim)
    except Mismatch:
        return x
    return out.to_local()


def failed_in(layer):
    """Notes the innermost layer whose call raised during a local run."""
    replay = _REPLAY.get()
    if replay is not None and replay.culprit is None:
        replay.culprit = layer


def _whole(placements, batch_dim):
    """`placements` with every model axis's shard replicated."""
    return tuple(
        Replicate() if i != batch_dim and p.is_shard() else p
        for i, p in enumerate(placements)
    )


def _to_dtensor(x, spec, mesh, batch_dim):
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    placements, shape = spec
    # The global stride follows the local one (an attention output is a
    # transposed view); the shape must come out as recorded (even shards).
    out = DTensor.from_local(x, mesh, placements, run_check=False)
    if tuple(out.shape) == shape:
        return out
    # The output of a boundary layer in `Record.replicated`: whole along
    # the model axes, cut to the recorded shards here (no communication).
    whole = _whole(placements, batch_dim)
    if whole != tuple(placements):
        out = DTensor.from_local(x, mesh, whole, run_check=False)
        if tuple(out.shape) == shape:
            return out.redistribute(mesh, placements)
    raise Mismatch(
        f"an input of local shape {tuple(x.shape)}, where the DTensor "
        f"run had {shape} as {placements}"
    )


def reduce_partial(x):
    """`x` with its partial sums (`Partial`) reduced to `Replicate`: what a
    row-split layer's output gets at its boundary (one all-reduce)."""
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        placements = [
            Replicate() if p.is_partial() else p for p in x.placements
        ]
        return x.redistribute(x.device_mesh, placements)
    return x


def boundary_call(replay, layer, original, args, kwargs, dtensor_scope):
    """Runs a boundary layer as DTensors inside a local run: inputs laid
    out as in the recorded DTensor run (its weights are DTensors there),
    outputs reduced and returned as local tensors."""
    key = (id(layer), replay.counts.get(id(layer), 0))
    replay.counts[id(layer)] = key[1] + 1
    recorded = replay.record.calls.get(key)
    flat = fast_tree.flatten((args, kwargs))
    if recorded is None or len(recorded) != len(flat):
        raise Mismatch(f"{layer.name!r}: a call the DTensor run did not make")
    done, outputs = local_split.call(
        replay, layer, original, args, kwargs, flat, recorded
    )
    if done:
        return outputs
    try:
        flat = [
            replay.to_dtensor(x, recorded_spec)
            for x, recorded_spec in zip(flat, recorded, strict=True)
        ]
    except Mismatch as error:
        raise Mismatch(f"{layer.name!r}: {error}") from None
    args, kwargs = fast_tree.pack_sequence_as((args, kwargs), flat)
    with dtensor_scope(layer):
        outputs = original(layer, *args, **kwargs)
    replicated = id(layer) in replay.record.replicated

    def to_local(x):
        x = reduce_partial(x)
        if not isinstance(x, DTensor):
            return x
        if replicated:
            whole = _whole(x.placements, replay.record.run_spec.dim)
            x = x.redistribute(x.device_mesh, whole)  # an all-gather
        return x.to_local(grad_placements=tuple(x.placements))

    return fast_tree.map_structure(to_local, outputs)


def outputs_global(record, mesh, outputs):
    """The local run's outputs as the DTensors the DTensor run returned."""
    flat = fast_tree.flatten(outputs)
    if len(flat) != len(record.outputs):
        raise Mismatch("the outputs differ in structure")
    flat = [
        _to_dtensor(x, spec, mesh, record.run_spec.dim)
        for x, spec in zip(flat, record.outputs, strict=True)
    ]
    return fast_tree.pack_sequence_as(outputs, flat)
