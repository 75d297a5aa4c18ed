"""`DataParallel` the DDP way: plain tensors, bucketed gradient all-reduce.

Under `keras.distribution.DataParallel` every variable is replicated, so
DTensor would only add per-op dispatch cost (20.6 vs 4.1 ms/step measured
on a width-128 MLP). Instead, in this "local" mode:

- variables are ordinary torch Parameters (rank 0's values are broadcast
  once, when training starts);
- each step computes on this process's rows of the global batch (a
  balanced split: sizes differ by at most one);
- gradients are all-reduced in buckets, launched from
  post-accumulate-grad hooks while backward is still running (DDP's
  overlap) and completed when backward ends, weighted by each rank's row
  count, so the update equals the one-process update on the global batch,
  uneven last batch included;
- metric states (sums and counts in every built-in Keras metric) are
  summed across ranks, so logs are global. The loss tracker, which Keras
  updates before backward, is summed by an all-reduce launched when
  backward starts, which completes with the gradient buckets; every other
  metric (compiled metrics are updated after the optimizer step) is
  summed by one all-reduce when Keras reads the results;
- inside `fit`, the optimizer update is split by variable (ZeRO stage 1
  on whole variables): each rank applies Keras's update to the variables
  it owns, after Keras has clipped and checked the whole global gradient,
  and broadcasts them; the optimizer slots of the variables a rank does
  not own go stale there and are brought back from their owners when
  `fit` returns and before every save;
- `predict` gathers every batch's rows back into the global order.
"""

import contextlib
import functools
import os
import weakref

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "GradientReducer",
    "UpdateSplit",
    "gather_rows",
    "row_counts",
    "world_size",
    "is_local_mode",
    "leading_rows",
    "local_rows",
    "metrics_result",
    "prepare_train_step",
    "record_slot",
    "split_update_step",
    "splitting_updates",
    "sync_optimizer_state",
    "split_within_fit",
]

_REDUCER = "_keras_dtensor_reducer"
_BUCKET_ENV = "KERAS_DTENSOR_BUCKET_MB"
_BUCKET_MB = 25  # DDP's default bucket_cap_mb
_FIRST_BUCKET_BYTES = 1024 * 1024
_SPLIT_ENV = "KERAS_DTENSOR_SPLIT_UPDATE"

# optimizer -> [(slot variable, the model variable it was made for)]
_SLOTS = weakref.WeakKeyDictionary()
# optimizer -> {id(model variable): owner rank} whose slots are stale on
# the other ranks
_STALE = weakref.WeakKeyDictionary()
# The UpdateSplit of the running DataParallel train step, if any.
_ACTIVE_SPLIT = None
_FIT_DEPTH = 0  # model.fit calls running


@functools.cache
def _data_parallel_class():
    from keras.src.distribution import DataParallel

    return DataParallel


def is_local_mode(distribution) -> bool:
    """Whether `distribution` runs as plain data parallelism.

    Called on every layer call: the class lookup is done once.
    """
    return isinstance(distribution, _data_parallel_class())


def _world():
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _row_split(total, world):
    sizes = [len(part) for part in np.array_split(np.arange(total), world)]
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    return list(zip(starts, sizes, strict=True))


def local_rows(batch, distribution, require_rows=True):
    """This process's rows of a batch, and how many there are.

    Args:
        batch: a nested structure of arrays/tensors (the global batch, or
            this process's own rows when `auto_shard_dataset=False`).
        distribution: the active `DataParallel`.
        require_rows: raise if a rank would get no rows (train/evaluate:
            an empty batch has no mean loss).

    Returns:
        `(local_batch, rows)`.
    """
    from keras.src import tree
    from keras.src.backend.torch.core import convert_to_tensor

    leaves = [x for x in tree.flatten(batch) if x is not None]
    if not leaves:
        return batch, 0
    total = int(leaves[0].shape[0])
    if not distribution.auto_shard_dataset:
        return tree.map_structure(_to_tensor, batch), total
    world, rank = _world()
    if require_rows and total < world:
        raise ValueError(
            f"A global batch of {total} rows cannot be split over {world} "
            "processes (some would get no rows, and an empty batch has no "
            "mean loss). Use a batch size of at least the number of "
            "processes, or drop the last partial batch."
        )
    start, length = _row_split(total, world)[rank]

    def cut(x):
        if x is None:
            return None
        return convert_to_tensor(x)[start : start + length]

    return tree.map_structure(cut, batch), length


def _to_tensor(x):
    from keras.src.backend.torch.core import convert_to_tensor

    return None if x is None else convert_to_tensor(x)


def world_size():
    """Processes in the job (1 without a process group)."""
    return _world()[0]


def leading_rows(batch):
    """Rows of a batch: the leading dim of its first array."""
    from keras.src import tree

    return int(next(x for x in tree.flatten(batch) if x is not None).shape[0])


def row_counts(batch, distribution):
    """Rows every rank computes on, in rank order, for this batch.

    A global batch is split by `_row_split` (no communication); with
    `auto_shard_dataset=False` each rank's own count is exchanged.
    """
    world, _ = _world()
    if distribution.auto_shard_dataset:
        return [n for _, n in _row_split(leading_rows(batch), world)]
    if world == 1:
        return [leading_rows(batch)]
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([leading_rows(batch)]))
    return [int(c.item()) for c in counts]


def gather_rows(outputs, counts):
    """All-gathers each rank's rows of `outputs` back into global order.

    Args:
        outputs: nested structure of tensors holding this rank's rows.
        counts: rows held by each rank, in rank order.

    Returns:
        The structure with the global rows, identical on every rank.
    """
    from keras.src import tree

    world, _ = _world()
    if world == 1:
        return outputs
    widest = max(counts)

    def gather(x):
        padded = x.new_zeros((widest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(
            [part[:n] for part, n in zip(parts, counts, strict=True)]
        )

    return tree.map_structure(gather, outputs)


class GradientReducer:
    """Bucketed, overlapped gradient all-reduce for a list of parameters.

    Parameters are grouped into buckets in reverse registration order
    (roughly the order backward produces gradients), one dtype per bucket,
    each bucket backed by one flat buffer kept across steps. When a
    parameter's gradient is complete (post-accumulate-grad hook), it is
    written into its slice of the buffer, already scaled by this rank's
    share of the global batch, and `.grad` becomes a view of that slice (the
    fresh gradient is freed); a bucket's all-reduce starts as soon as its
    last gradient is in, while backward goes on. `finish()` waits: the
    buffers then hold the global-batch gradient and every `.grad` already
    points at it (DDP's `gradient_as_bucket_view`), so nothing is copied
    back.

    Args:
        params: the trainable torch Parameters.
        bucket_bytes: bucket capacity; defaults to
            `$KERAS_DTENSOR_BUCKET_MB` or 25 MiB, DDP's default (the first
            bucket is 1 MiB, so the first all-reduce starts early).
    """

    def __init__(self, params, bucket_bytes=None):
        if bucket_bytes is None:
            bucket_bytes = int(
                float(os.environ.get(_BUCKET_ENV, _BUCKET_MB)) * 2**20
            )
        self.params = list(params)
        self.buckets = []
        bucket, size, cap = [], 0, _FIRST_BUCKET_BYTES
        for p in reversed(self.params):
            if bucket and (size >= cap or p.dtype != bucket[0].dtype):
                self.buckets.append(bucket)
                bucket, size, cap = [], 0, bucket_bytes
            bucket.append(p)
            size += p.numel() * p.element_size()
        if bucket:
            self.buckets.append(bucket)
        self.buffers = [
            torch.empty(
                sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device
            )
            for b in self.buckets
        ]
        self.slot = {}  # id(param) -> (bucket index, view of its slice)
        for index, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                n = p.numel()
                view = self.buffers[index][offset : offset + n].view_as(p)
                self.slot[id(p)] = (index, view)
                offset += n
        self.step = None  # the train function this reducer was built for
        self.split = None  # the UpdateSplit of its optimizer updates
        self.model = None  # weakref to the model, whose loss tracker to sum
        self.early = None  # the EarlyMetrics of the latest train step
        self.active = False  # only inside a DataParallel train step
        self.weight = 1.0
        self.rows = None
        self._reset()
        self.handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for p in self.params
        ]

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.works = {}
        self.queued = False
        self.total_rows = None

    def begin(self, rows, global_rows=None):
        """Arms the reducer for one train step.

        Args:
            rows: rows of the batch this rank computes on.
            global_rows: rows of the global batch, when every rank knows it
                (a global batch split here); `None` when each process feeds
                its own rows, which then are summed with the gradients.
        """
        self.active = True
        self.rows = rows
        self.weight = None if global_rows is None else rows / global_rows

    def _on_grad(self, param):
        if not self.active:
            return
        if not self.queued:
            # Like DDP: finish the reductions when backward completes, so
            # `.grad` is global before any optimizer (LossScaleOptimizer's
            # finiteness check included) or user code reads it.
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish
            )
            model = self.model() if self.model is not None else None
            tracker = getattr(model, "_loss_tracker", None)
            if tracker is not None and tracker.variables:
                self.early = EarlyMetrics([v.value for v in tracker.variables])
            if self.weight is None:  # per-process rows: sum them too
                self.total_rows = torch.tensor(
                    [float(self.rows)], dtype=torch.float64
                )
                self.works["rows"] = dist.all_reduce(
                    self.total_rows, async_op=True
                )
        index, view = self.slot[id(param)]
        # Each rank's loss is a mean over its rows: weight by rows.
        scale = float(self.rows) if self.weight is None else self.weight
        torch.mul(param.grad, scale, out=view)
        param.grad = view
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            self._launch(index)

    def _launch(self, index):
        self.works[index] = dist.all_reduce(self.buffers[index], async_op=True)

    def finish(self):
        """Completes every bucket's all-reduce; `.grad` holds the result."""
        if not self.works and not any(self.ready):
            return
        for index, bucket in enumerate(self.buckets):
            if index in self.works:
                continue
            # Some parameters got no gradient: they contribute zeros.
            for p in bucket:
                if p.grad is None or p.grad is not self.slot[id(p)][1]:
                    self.slot[id(p)][1].zero_()
            self._launch(index)
        rows = self.works.pop("rows", None)
        if rows is not None:
            rows.wait()
        for index, work in sorted(self.works.items()):
            work.wait()
            if self.total_rows is not None:
                self.buffers[index].div_(float(self.total_rows))
            for p in self.buckets[index]:
                p.grad = self.slot[id(p)][1]
        self._reset()

    def remove(self):
        for handle in self.handles:
            handle.remove()


class EarlyMetrics:
    """Metric states summed over every rank by an all-reduce launched now.

    Launched when a train step's backward starts (for the loss tracker,
    which Keras's train step updates before backward), the sum travels
    with the gradient buckets instead of making every step wait on one
    more collective after the optimizer. `summed()` gives the sum of each
    state that still holds the value it had at launch (same tensor, same
    `_version`: no in-place write since, as when a custom train step
    updates the tracker after backward: then it is summed when read, on
    every rank alike).

    Args:
        states: the metric state tensors, in the same order on every rank.
    """

    def __init__(self, states):
        self.states = states
        self.versions = [s._version for s in states]
        self.flat = _flat_double(states)
        self.work = dist.all_reduce(self.flat, async_op=True)

    def summed(self):
        """`{id(state): summed value}` for the states unchanged since."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        out = {}
        for s, version, value in zip(
            self.states,
            self.versions,
            _unflatten(self.flat, self.states),
            strict=True,
        ):
            if s._version == version:
                out[id(s)] = value
        return out


def _flat_double(tensors):
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _unflatten(flat, like):
    """Views of `flat` shaped (and cast) like each tensor of `like`."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view_as(t).to(t.dtype))
        offset += n
    return out


def _broadcast_from_owners(tensors, owners):
    """Each tensor gets its owner rank's value, in place.

    One flat broadcast per (owner, dtype), all in flight at once; no casts.
    Every rank must pass the same shapes, dtypes and owners, in the same
    order.
    """
    _, rank = _world()
    groups = {}
    for t, owner in zip(tensors, owners, strict=True):
        groups.setdefault((owner, t.dtype), []).append(t)
    pending = []
    with torch.no_grad():
        for owner, dtype in sorted(groups, key=lambda k: (k[0], str(k[1]))):
            group = groups[(owner, dtype)]
            if owner == rank:
                flat = torch.cat([t.detach().reshape(-1) for t in group])
            else:
                flat = torch.empty(
                    sum(t.numel() for t in group),
                    dtype=dtype,
                    device=group[0].device,
                )
            work = dist.broadcast(flat, src=owner, async_op=True)
            pending.append((owner, group, flat, work))
        for owner, group, flat, work in pending:
            work.wait()
            if owner == rank:
                continue
            views = flat.split([t.numel() for t in group])
            torch._foreach_copy_(
                group,
                [v.view_as(t) for v, t in zip(views, group, strict=True)],
            )


def _broadcast_from_rank0(variables):
    """Rank 0's values everywhere (as DDP does at construction)."""
    values = [v.value for v in variables]
    _broadcast_from_owners(values, [0] * len(values))


class UpdateSplit:
    """Which rank applies the optimizer update to which variable.

    Whole variables are dealt out, largest first, to the rank with the
    fewest elements so far (the same on every rank). Splitting whole
    variables keeps every Keras update exact, factored and per-matrix ones
    included; with fewer variables than ranks there is no split.

    Args:
        variables: the model's trainable Keras variables.
    """

    def __init__(self, variables):
        self.world, self.rank = _world()
        self.owner = {}
        self.checked = weakref.WeakKeyDictionary()  # optimizer -> bool
        self.depth = 0
        variables = list(variables)
        if len(variables) < self.world:
            return
        sizes = [int(np.prod(v.shape)) for v in variables]
        load = [0] * self.world
        for i in sorted(range(len(variables)), key=lambda i: -sizes[i]):
            rank = load.index(min(load))
            self.owner[id(variables[i])] = rank
            load[rank] += sizes[i]

    def splits(self, optimizer):
        """Whether `optimizer`'s update can be split (cached)."""
        if not self.owner:
            return False
        known = self.checked.get(optimizer)
        if known is None:
            known = self.checked[optimizer] = _splittable(optimizer)
        return known


def _keras_defined(cls, name):
    function = getattr(cls, name, None)
    return function is None or getattr(function, "__module__", "").startswith(
        "keras."
    )


def _splittable(optimizer):
    """An update splits by variable when it is Keras's own per-variable
    update and every non-scalar optimizer variable is a slot of one model
    variable (made by `add_variable_from_reference`), so that it can be
    brought back from the variable's owner."""
    if os.environ.get(_SPLIT_ENV, "1") == "0":
        return False
    # `update_step` is per variable by contract; a custom parallel step
    # may couple variables.
    if not _keras_defined(type(optimizer), "_parallel_update_step"):
        return False
    slots = {id(slot) for slot, _ in _SLOTS.get(optimizer, ())}
    return all(id(v) in slots or len(v.shape) == 0 for v in optimizer.variables)


def split_update_step(original):
    """Wraps an optimizer's `_backend_update_step(grads, variables, lr)`.

    Inside a DataParallel train step (where every rank holds the global
    gradient), each rank updates only the variables it owns, then the
    updated variables are broadcast from their owners. Keras's clipping,
    loss-scale check, weight decay and gradient accumulation ran before
    this on the whole gradient; EMA and constraints run after it on the
    synced variables. Otherwise the original runs unchanged.
    """

    @functools.wraps(original)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        split = _ACTIVE_SPLIT
        if split is None or split.depth or not split.splits(self):
            return original(self, grads, trainable_variables, learning_rate)
        grads, variables = list(grads), list(trainable_variables)
        owners = [split.owner.get(id(v)) for v in variables]
        if None in owners or len(set(owners)) < split.world:
            # Variables from outside the model, or a rank with nothing to
            # update (its per-call scalars would fall behind): whole update.
            return original(self, grads, variables, learning_rate)
        mine = [i for i, owner in enumerate(owners) if owner == split.rank]
        split.depth += 1
        try:
            original(
                self,
                [grads[i] for i in mine],
                [variables[i] for i in mine],
                learning_rate,
            )
        finally:
            split.depth -= 1
        _broadcast_from_owners([v.value for v in variables], owners)
        stale = _STALE.setdefault(self, {})
        for v, owner in zip(variables, owners, strict=True):
            stale[id(v)] = owner

    return _backend_update_step


@contextlib.contextmanager
def splitting_updates(split):
    """Optimizer updates inside this context are split by `split`, if it
    runs inside `fit` (whose end brings stale slots back): a
    `train_on_batch` loop updates whole, and its optimizer state is whole
    after every call."""
    global _ACTIVE_SPLIT
    previous = _ACTIVE_SPLIT
    _ACTIVE_SPLIT = split if _FIT_DEPTH else None
    try:
        yield
    finally:
        _ACTIVE_SPLIT = previous


def record_slot(original):
    """Wraps `BaseOptimizer.add_variable_from_reference`: remembers which
    model variable each optimizer slot belongs to."""

    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        slot = original(self, reference_variable, *args, **kwargs)
        _SLOTS.setdefault(self, []).append((slot, reference_variable))
        return slot

    return add_variable_from_reference


def sync_optimizer_state():
    """Brings every stale optimizer slot back from its variable's owner.

    A collective when anything is stale: every rank must call it at the
    same point (the end of `fit`, every save, a new train function).
    """
    if _world()[0] == 1:  # no group (any more): nothing to bring back
        _STALE.clear()
        return
    for optimizer, stale in list(_STALE.items()):
        if not stale:
            continue
        pairs = [
            (slot, stale[id(ref)])
            for slot, ref in _SLOTS.get(optimizer, ())
            if slot is not None and id(ref) in stale
        ]
        if pairs:
            _broadcast_from_owners(
                [slot.value for slot, _ in pairs],
                [owner for _, owner in pairs],
            )
        stale.clear()


def split_within_fit(original):
    """Wraps `TorchTrainer.fit`: optimizer updates split only inside `fit`,
    and the optimizer state is whole on every rank when it returns (see
    `split_update_step`)."""

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        global _FIT_DEPTH
        _FIT_DEPTH += 1
        try:
            history = original(self, *args, **kwargs)
        finally:
            _FIT_DEPTH -= 1
        sync_optimizer_state()
        return history

    return fit


def prepare_train_step(model):
    """Builds the model's gradient reducer (once per train function).

    Also broadcasts rank 0's weights, as DDP does at construction, so every
    replica starts from the same values.

    Returns:
        The `GradientReducer`, also kept on the model.
    """
    world, _ = _world()
    old = getattr(model, _REDUCER, None)
    if old is not None:
        old.remove()
    if world == 1:
        return None
    sync_optimizer_state()  # the owners may change
    _broadcast_from_rank0(model.variables)
    reducer = GradientReducer([v.value for v in model.trainable_weights])
    reducer.split = UpdateSplit(model.trainable_weights)
    reducer.model = weakref.ref(model)
    object.__setattr__(model, _REDUCER, reducer)
    return reducer


def metrics_result(original):
    """Wraps `Trainer.get_metrics_result`: in local mode, results come from
    metric states summed over every rank: those the train step's early
    all-reduce already summed (see `EarlyMetrics`), the rest by one
    all-reduce now."""

    def get_metrics_result(self):
        from keras.src.backend.common import global_state

        # Which states are summed now is decided by structure (every metric
        # but the loss tracker, whose early sum is still current), never by
        # data, so every rank joins the same all-reduce.
        distribution = global_state.get_global_attribute("distribution")
        world, _ = _world()
        if world == 1 or not is_local_mode(distribution):
            return original(self)
        metrics = list(self.metrics)
        states = [[v.value for v in m.variables] for m in metrics]
        flat_states = [s for group in states for s in group]
        if not flat_states:
            return original(self)
        reducer = getattr(self, _REDUCER, None)
        early = reducer.early if reducer is not None else None
        summed = early.summed() if early is not None else {}
        late = [s for s in flat_states if id(s) not in summed]
        if late:
            flat = _flat_double(late)
            dist.all_reduce(flat)
            for s, value in zip(late, _unflatten(flat, late), strict=True):
                summed[id(s)] = value
        results = {}
        for metric, group in zip(metrics, states, strict=True):
            result = metric.stateless_result([summed[id(s)] for s in group])
            if isinstance(result, dict):
                results.update(result)
            else:
                results[metric.name] = result
        return results

    return get_metrics_result
