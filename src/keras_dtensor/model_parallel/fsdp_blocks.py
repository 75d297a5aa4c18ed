"""Batch-sharded weights gathered as FSDP2 gathers them.

Outside a local run, by the layer that owns them, for its call
(`gathered_weights`); in one, group by group (`Session`): gathered before
the group's forward, freed after it, gathered again for its backward.
Every rank runs the same layers in the same order: the collectives match.
"""

import collections
import contextlib
import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor import config
from keras_dtensor.backend import object_state
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import packed_gather
from keras_dtensor.ops.flat_buffers import buckets
from keras_dtensor.ops.flat_buffers import nbytes

__all__ = [
    "Layout",
    "Session",
    "batch_placement",
    "build",
    "gathered_weights",
]

_PLAN = "_keras_dtensor_weight_gather"


def batch_placement(value, batch_axis):
    """`(batch axis's mesh dim, its Shard or None)`, or None when `value`
    is no DTensor on a mesh with the batch axis."""
    if not isinstance(value, DTensor):
        return None
    names = value.device_mesh.mesh_dim_names or ()
    if batch_axis not in names:
        return None
    dim = names.index(batch_axis)
    placement = value.placements[dim]
    return dim, placement if placement.is_shard() else None


def _plan(layer, batch_axis):
    """`(variable, gathered placements)` of the layer's own batch-sharded
    trainable variables, cached until their number changes (LoRA)."""
    own = layer.__dict__.get("_trainable_variables")
    if not own:
        return ()
    cached = object_state.get_on(layer, _PLAN)
    if cached is not None and cached[0] == len(own):
        return cached[1]
    plan = []
    for variable in own:
        value = getattr(variable, "_value", None)
        found = batch_placement(value, batch_axis)
        if found is not None and found[1] is not None:
            placements = list(value.placements)
            placements[found[0]] = Replicate()
            plan.append((variable, tuple(placements)))
    return object_state.set_on(layer, _PLAN, (len(own), tuple(plan)))[1]


@contextlib.contextmanager
def _swapped(plan):
    saved = []
    try:
        for variable, placements in plan:
            shard = variable._value
            variable._value = shard.redistribute(shard.device_mesh, placements)
            saved.append((variable, shard))
        yield
    finally:
        for variable, shard in saved:
            variable._value = shard


def gathered_weights(layer, distribution):
    """A context in which `layer`'s batch-sharded weights read gathered."""
    if not layer.built or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    plan = _plan(layer, distribution.batch_dim_name)
    if not plan:
        return contextlib.nullcontext()
    return _swapped(plan)


_MARK = object()


@dataclasses.dataclass
class Layout:
    """A model's gathered weights by group, in call order; `root`, those
    gathered for the whole call; `order`, the call order built from (None:
    the layers' order); `failed`, a grouped call met a freed weight."""

    groups: tuple
    unit_group: dict
    root: tuple
    order: tuple | None
    failed: bool = False


def _units(model):
    """`{id(variable): {id(unit), ...}}` and the units' ids, in order."""
    from keras import Model

    owners, units = collections.defaultdict(set), []

    def walk(layer):
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if isinstance(child, Model):
                walk(child)
                continue
            units.append(id(child))
            for variable in child.weights:
                owners[id(variable)].add(id(child))

    walk(model)
    return owners, units


def build(model, run_spec, order):
    """`model`'s `Layout` in `order` (ids of the units a call reached), or
    None when grouping frees nothing."""
    owners, units = _units(model)
    by_unit = collections.defaultdict(list)
    root = []
    calls = collections.Counter(order or ())
    for i in run_spec.gathered:
        found = owners.get(id(run_spec.weights[i][0]), ())
        unit = next(iter(found)) if len(found) == 1 else None
        if unit is None or calls[unit] > 1:
            root.append(i)  # shared, or called again (a tied projection)
        else:
            by_unit[unit].append(i)
    # A group is packed in one buffer of one dtype: a unit of several
    # dtypes is gathered with the root, per dtype.
    dtypes = {
        unit: {run_spec.weights[i][0]._value.dtype for i in indices}
        for unit, indices in by_unit.items()
    }
    for unit in [unit for unit, kinds in dtypes.items() if len(kinds) > 1]:
        root.extend(by_unit.pop(unit))
    # Units in call order, those the first call did not reach at the end.
    ranked = dict.fromkeys([*(order or ()), *units])
    ranked = [unit for unit in ranked if unit in by_unit]
    sizes = [
        sum(nbytes(run_spec.weights[i][0]._value) for i in by_unit[unit])
        for unit in ranked
    ]
    keys = [next(iter(dtypes[unit])) for unit in ranked]
    groups, unit_group = [], {}
    cap = config.get("GATHER_MB") * 2**20
    for bucket in buckets(sizes, cap, keys=keys):
        for j in bucket:
            unit_group[ranked[j]] = len(groups)
        groups.append(tuple(i for j in bucket for i in by_unit[ranked[j]]))
    if len(groups) < 2:
        return None
    return Layout(
        tuple(groups),
        unit_group,
        tuple(root),
        None if order is None else tuple(order),
    )


class Session:
    """The gathers of one grouped call and of its backward."""

    def __init__(self, run_spec, layout, values, group):
        self.run_spec, self.layout, self.values = run_spec, layout, values
        self.group = group
        self.last = len(layout.groups) - 1
        self.current = None
        self.forward = {}  # group -> its gathered full tensors
        self.pending = {}  # group -> (Pending, shards): started gathers
        self.ptrs = {}  # storage -> (group, index in it, dtype)
        self.packed = collections.Counter()
        self.back = {}  # group -> its full tensors, gathered in backward
        self.back_pending = {}
        # Units in call order, for a layout made in the layers' order.
        self.order = [] if layout.order is None else None

    def _start(self, indices):
        values = [self.values[i] for i in indices]
        shards = local_grads.local_many(values)
        dim = self.run_spec.dim
        specs = [(v.placements[dim].dim, tuple(v.shape)) for v in values]
        return packed_gather.Pending(shards, specs, self.group), shards

    def gather_root(self):
        """`{index: full}` of the root weights, one all-gather per dtype."""
        by_dtype, out = {}, {}
        for i in self.layout.root:
            by_dtype.setdefault(self.values[i].dtype, []).append(i)
        for indices in by_dtype.values():
            fulls = packed_gather.finish(*self._start(indices))
            out.update(zip(indices, fulls, strict=True))
        return out

    def enter(self, layer):
        """Called as `layer` is called: its group gathered, the last freed."""
        g = self.layout.unit_group.get(id(layer))
        if g is None:
            return
        if self.order is not None:
            self.order.append(id(layer))
        if g == self.current:
            return
        if self.current is not None:
            self._release(self.current)
        self.current = g
        if g not in self.forward:
            self._gather(g)

    def _gather(self, g):
        indices = self.layout.groups[g]
        pending, shards = self.pending.pop(g, None) or self._start(indices)
        fulls = packed_gather.finish(pending, shards)
        for i, full in zip(indices, fulls, strict=True):
            self.run_spec.weights[i][0]._value = full
        if g != self.last:  # each full tensor has a storage of its own
            for k, full in enumerate(fulls):
                ptr = full.untyped_storage().data_ptr()
                self.ptrs[ptr] = (g, k, full.dtype)
        self.forward[g] = fulls
        ahead = g + 1
        if ahead <= self.last and ahead not in (*self.forward, *self.pending):
            self.pending[ahead] = self._start(self.layout.groups[ahead])

    def _release(self, g):
        if g == self.last:
            return
        for i in self.layout.groups[g]:
            self.run_spec.weights[i][0]._value = self.values[i]
        for full in self.forward.pop(g):
            self.ptrs.pop(full.untyped_storage().data_ptr(), None)

    def close(self):
        """Every group let go (the last lives on in what autograd saved)."""
        if self.current is not None:
            self._release(self.current)
        self.current = None
        for pending, _ in self.pending.values():
            pending.wait()
        self.pending.clear()
        self.forward.clear()
        self.ptrs.clear()

    def pack(self, tensor):
        if not self.ptrs or type(tensor) is not torch.Tensor:
            return tensor
        hit = self.ptrs.get(tensor.untyped_storage().data_ptr())
        if hit is None or hit[2] != tensor.dtype:
            return tensor
        g, k, _ = hit
        self.packed[g] += 1
        view = (tensor.size(), tensor.stride(), tensor.storage_offset())
        return (_MARK, g, k, view)

    def unpack(self, packed):
        if type(packed) is not tuple or packed[0] is not _MARK:
            return packed
        _, g, k, view = packed
        fulls = self.back.get(g)
        if fulls is None:
            fulls = self._regather(g)
        self.packed[g] -= 1
        if self.packed[g] <= 0:
            self.back.pop(g, None)
        return fulls[k].as_strided(*view)

    def _regather(self, g):
        started = self.back_pending.pop(g, None)
        if started is None:
            started = self._start_values(g)
        with torch.no_grad():
            fulls = started.wait()
        self.back[g] = fulls
        before = g - 1
        started = (*self.back, *self.back_pending)
        if before >= 0 and self.packed[before] > 0 and before not in started:
            self.back_pending[before] = self._start_values(before)
        return fulls

    def _start_values(self, g):
        with torch.no_grad():
            return self._start(self.layout.groups[g])[0]
