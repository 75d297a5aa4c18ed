"""Batch-sharded weights gathered group by group, freed after their forward.

On the local path (`local_run`), gathering every batch-sharded weight at
once would hold the whole model on every rank from the first layer's
forward to its backward: the memory FSDP exists to avoid. FSDP2 gathers a
block's parameters before its forward, frees them after it
(`reshard_after_forward`) and gathers them again before the block's
backward. The same here, with Keras's layers as the blocks:

- A unit is a layer directly under the model (under nested models: a
  keras_hub task's backbone counts as part of the task); its gathered
  weights are those of the unit and its sublayers. Consecutive units, in
  the order the model's first call reached them (in the layers' order
  during that call), form groups of at least
  `KERAS_DTENSOR_GATHER_MB` (FSDP2's blocks; the default keeps a model of
  a few tens of MB in one group, which changes nothing). A weight of no
  unit or of several (shared), or of a unit the call reached more than
  once (a tied embedding, called again for the output projection), is
  gathered for the whole call, as FSDP2's root module's parameters are.
- Calling a unit gathers its group (one all-gather) and starts the next
  group's gather; calling a unit of another group frees the last one: its
  weights read as shards again, and the tensors autograd saved from them
  are kept as their place in the gathered storage, not the storage
  (`torch.autograd.graph.saved_tensors_hooks`). The last group stays (its
  backward comes first).
- In backward, the first saved tensor of a freed group to be needed
  gathers it again (the next one's gather is started), and it is let go
  once all its saved tensors have been used. Gradients still leave by the
  gather's own backward: one reduce-scatter per group.

Every rank runs the same layers in the same order, so the collectives
match. A model that reads a freed weight outside its unit's call (a
DTensor meeting local tensors) is detected by the error this raises and
runs with all weights gathered from then on (`local_run.call`).
"""

import collections
import dataclasses
import functools

import torch

from keras_dtensor import config
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import packed_gather

__all__ = ["Layout", "Session", "build"]

_MARK = object()


@dataclasses.dataclass
class Layout:
    """How one model's gathered weights are grouped.

    `groups`: tuples of indices into the plan's weights, in call order;
    `unit_group`: id(unit layer) -> its group; `root`: indices gathered
    for the whole call; `order`: the call order it was built from (None:
    the layers' order, before a first call); `failed`: a grouped call met
    a freed weight.
    """

    groups: tuple
    unit_group: dict
    root: tuple
    order: tuple | None
    failed: bool = False

    @functools.cached_property
    def grouped(self):
        """Indices of every weight some group gathers."""
        return frozenset(i for group in self.groups for i in group)


def _units(model):
    """`{id(variable): [id(unit), ...]}` and the units, in layer order."""
    from keras import Model

    owners = collections.defaultdict(list)
    units = []

    def walk(layer):
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if isinstance(child, Model):
                walk(child)
                continue
            units.append(child)
            for variable in child.weights:
                owners[id(variable)].append(id(child))

    walk(model)
    return owners, units


def build(model, run_spec, order):
    """The model's `Layout`, or None when grouping frees nothing.

    Args:
        model: the outermost layer the plan runs.
        run_spec: its `LocalRunSpec`.
        order: ids of the units a call reached, in call order; None
            before the first call (the layers' own order).
    """
    owners, units = _units(model)
    by_unit = collections.defaultdict(list)
    root = []
    calls = collections.Counter(order or ())
    for i in run_spec.gathered:
        found = set(owners.get(id(run_spec.weights[i][0]), ()))
        unit = found.pop() if len(found) == 1 else None
        if unit is None or calls[unit] > 1:
            root.append(i)  # shared, or called again (a tied projection)
        else:
            by_unit[unit].append(i)
    ranked = {}
    for layer_id in order or ():
        if layer_id in by_unit:
            ranked.setdefault(layer_id, len(ranked))
    for unit in units:  # units the first call did not reach: at the end
        if id(unit) in by_unit:
            ranked.setdefault(id(unit), len(ranked))
    limit = config.get("GATHER_MB") * 2**20
    groups, unit_group, current, size = [], {}, [], 0
    for layer_id in sorted(ranked, key=ranked.get):
        if current and size >= limit:
            groups.append(tuple(current))
            current, size = [], 0
        unit_group[layer_id] = len(groups)
        for i in by_unit[layer_id]:
            value = run_spec.weights[i][0]._value
            current.append(i)
            size += value.numel() * value.element_size()
    if current:
        groups.append(tuple(current))
    if len(groups) < 2:
        return None
    return Layout(
        tuple(groups),
        unit_group,
        tuple(root),
        None if order is None else tuple(order),
    )


class Session:
    """The gathers of one grouped call, and of its backward.

    Args:
        run_spec: the model's `LocalRunSpec`.
        layout: its `Layout`.
        values: the weights' DTensor values, in the plan's order.
        group: the process group of the batch axis.
    """

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
        # Units in the order this call reaches them, while the layout's
        # groups follow the layers' order (a model's first call).
        self.order = [] if layout.order is None else None

    # ----------------------------------------------------------- forward

    def _specs(self, indices):
        dim = self.run_spec.dim
        return [
            (self.values[i].placements[dim].dim, tuple(self.values[i].shape))
            for i in indices
        ]

    def _start(self, indices):
        shards = local_grads.local_many([self.values[i] for i in indices])
        pending = packed_gather.start(shards, self._specs(indices), self.group)
        return pending, shards

    def gather_root(self):
        """`{index: full}` of the weights gathered for the whole call."""
        if not self.layout.root:
            return {}
        fulls = packed_gather.finish(*self._start(self.layout.root))
        return dict(zip(self.layout.root, fulls, strict=True))

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
        following = g + 1
        if (
            following <= self.last
            and following not in self.forward
            and following not in self.pending
        ):
            self.pending[following] = self._start(self.layout.groups[following])

    def _release(self, g):
        if g == self.last:
            return
        for i in self.layout.groups[g]:
            self.run_spec.weights[i][0]._value = self.values[i]
        for full in self.forward.pop(g):
            self.ptrs.pop(full.untyped_storage().data_ptr(), None)

    def close(self):
        """The call is over: every group let go (the last one stays
        alive through what autograd saved of it), started gathers done."""
        if self.current is not None:
            self._release(self.current)
        self.current = None
        for pending, _ in self.pending.values():
            pending.wait()
        self.pending.clear()
        self.forward.clear()
        self.ptrs.clear()

    # ------------------------------------------------- saved tensors hooks

    def pack(self, tensor):
        if not self.ptrs or type(tensor) is not torch.Tensor:
            return tensor
        hit = self.ptrs.get(tensor.untyped_storage().data_ptr())
        if hit is None or hit[2] != tensor.dtype:
            return tensor
        g, k, _ = hit
        self.packed[g] += 1
        return (
            _MARK,
            g,
            k,
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
        )

    def unpack(self, packed):
        if type(packed) is not tuple or packed[0] is not _MARK:
            return packed
        _, g, k, size, stride, offset = packed
        fulls = self.back.get(g)
        if fulls is None:
            fulls = self._regather(g)
        self.packed[g] -= 1
        if self.packed[g] <= 0:
            self.back.pop(g, None)
        return fulls[k].as_strided(size, stride, offset)

    def _regather(self, g):
        started = self.back_pending.pop(g, None)
        if started is None:
            started = self._start_values(g)
        with torch.no_grad():
            fulls = started.wait()
        self.back[g] = fulls
        before = g - 1
        if (
            before >= 0
            and self.packed[before] > 0
            and before not in self.back
            and before not in self.back_pending
        ):
            self.back_pending[before] = self._start_values(before)
        return fulls

    def _start_values(self, g):
        indices = self.layout.groups[g]
        with torch.no_grad():
            shards = [self.values[i].to_local() for i in indices]
        return packed_gather.start(shards, self._specs(indices), self.group)
