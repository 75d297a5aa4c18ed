"""Tensor-parallel layers as DTensor islands in a call on local tensors.

Following a `Record` (`Replay`), a boundary layer's inputs become DTensors
placed as recorded; its outputs leave local, partial sums reduced (one
all-reduce), or all-gathered where recorded replicated.
"""

import contextvars
import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.model_parallel import local_split
from keras_dtensor.model_parallel import reference_run

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
    """The local run parted from the DTensor run."""


@dataclasses.dataclass
class Replay:
    """A local run following `record` (a `Record`)."""

    record: object
    mesh: object
    counts: dict = dataclasses.field(default_factory=dict)
    culprit: object = None  # the innermost layer whose call raised
    values_differ: bool = False  # a traced layer's values differed here
    # The last input wrapped (`local_split`: copied in): given to query,
    # key and value, wrapped once, their gradients add up as one sum.
    wrapped: tuple = (None, None)
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
    return context.scoped(_REPLAY, replay)


def current_replay():
    """The `Replay` of the local run in progress, or None."""
    return _REPLAY.get()


def checked_call(replay, layer, original, args, kwargs):
    """A traced layer call: its outputs' fingerprint must be as recorded."""
    key = reference_run.next_key(replay.counts, layer)
    outputs = original(layer, *args, **kwargs)
    expected, specs = replay.record.fingerprints.get(key, (None, ()))
    flat = fast_tree.flatten(outputs)
    if len(specs) == len(flat):
        # An output handed on whole is compared by its recorded shard.
        flat = [
            _as_shard(x, s, replay) for x, s in zip(flat, specs, strict=True)
        ]
    got = reference_run.fingerprint(flat)
    if got != expected:
        failed_in(layer)
        shapes = [f[0] for f in got]
        if expected is None or shapes != [f[0] for f in expected]:
            raise Mismatch(f"{layer.name!r}: its outputs differ")
        # Values only, maybe on this rank only: raising would leave the
        # other ranks in the next collective. Agreed when the run ends.
        replay.values_differ = True
    return outputs


def _as_shard(x, recorded, replay):
    if isinstance(x, DTensor):
        return x
    try:
        out = _to_dtensor(x, recorded, replay.mesh, replay.record.run_spec.dim)
    except Mismatch:
        return x
    return out.to_local() if isinstance(out, DTensor) else out


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
    # Handed on whole: cut to the recorded shards (no communication).
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
    """`x` with its partial sums reduced to `Replicate` (one all-reduce)."""
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        placements = [
            Replicate() if p.is_partial() else p for p in x.placements
        ]
        return x.redistribute(x.device_mesh, placements)
    return x


def boundary_call(replay, layer, original, args, kwargs, dtensor_scope):
    """A boundary layer's call on its shards, or as DTensors placed as
    recorded in `dtensor_scope(layer)`; returns local tensors."""
    key = reference_run.next_key(replay.counts, layer)
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
