"""Gradient reduction of a DataParallel train step, as DDP's reducer does it.

Buckets are all-reduced while backward goes on, each rank weighted by its
share of the rows, or sent to their owners (ZeRO stage 2); metric states
and the row count ride in the last bucket's tail.
Design: `docs/internals/data-parallel.md`.
"""

import weakref

import torch
import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor.backend.launch import world
from keras_dtensor.data_parallel.metrics import EarlyMetrics
from keras_dtensor.data_parallel.state import state_of
from keras_dtensor.ops import flat_buffers

__all__ = ["GradientReducer"]

_FIRST_BUCKET_BYTES = 1024 * 1024  # small: the first all-reduce starts early
_TAIL_ROOM = 16  # spare elements after each bucket, grown on demand


class GradientReducer:
    """Bucketed, overlapped gradient all-reduce of `params`, `.grad` a view
    of its bucket; with `owners` each bucket is laid out by owner."""

    def __init__(self, params, model, owners=None):
        bucket_bytes = int(config.get("BUCKET_MB") * 2**20)
        self.params = list(params)
        order = self.params[::-1]
        owner_of = dict(zip(map(id, self.params), owners or (), strict=False))
        self.owners = bool(owners)
        runs = flat_buffers.buckets(
            [flat_buffers.nbytes(p) for p in order],
            bucket_bytes,
            keys=[p.dtype for p in order],
            first_cap=_FIRST_BUCKET_BYTES,
        )
        self.buckets = [
            sorted((order[i] for i in b), key=lambda p: owner_of.get(id(p), 0))
            for b in runs
        ]
        self.sizes = [sum(p.numel() for p in b) for b in self.buckets]
        # The widest state every bucket sums without rounding (0: none).
        floats = (torch.float32, torch.float64)
        widths = [
            b[0].element_size() * (b[0].dtype in floats) for b in self.buckets
        ]
        self.tail_width = min(widths, default=0)
        self._allocate(_TAIL_ROOM)
        self.world, self.rank = world()
        # Per bucket: {owner: (start, stop)}; (peer, buffer) pairs received.
        self.segments, self.inbox = [], []
        for index, bucket in enumerate(self.buckets):
            segments, offset = {}, 0
            for p in bucket:
                owner = owner_of.get(id(p))
                start, stop = segments.get(owner, (offset, offset))
                segments[owner] = (start, stop + p.numel())
                offset += p.numel()
            self.segments.append(segments)
            start, stop = segments.get(self.rank, (0, 0))
            peers = range(self.world) if owners and stop > start else ()
            self.inbox.append(
                [
                    (r, self.buffers[index].new_empty(stop - start))
                    for r in peers
                    if r != self.rank
                ]
            )
        self.model = weakref.ref(model)
        self.early = None  # the EarlyMetrics of the latest train step
        self.active = False  # only inside a DataParallel train step
        self.metrics_updated = False  # by `metrics.wrap_compute_loss`
        self.weight = 1.0
        self.rows = None
        self.to_owners = False
        self._reset()
        self.handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for p in self.params
        ]

    def _allocate(self, tail_room):
        """The bucket buffers, `tail_room` spare elements each."""
        self.tail_room = tail_room
        self.buffers, self.slot = [], {}  # slot: id(param) -> (bucket, view)
        for index, bucket in enumerate(self.buckets):
            flat, places = flat_buffers.flat_views(bucket, room=tail_room)
            self.buffers.append(flat)
            for p, place in zip(bucket, places, strict=True):
                self.slot[id(p)] = (index, place)

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.works = {}
        self.rows_work = None  # the row count's own all-reduce
        self.queued = False
        self.total_rows = None
        self.tail = None  # the sums the last bucket carries, flat, float64
        self.tail_at = None  # the bucket that carried them

    def begin(self, rows, global_rows=None, to_owners=False):
        """Arms the reducer for a train step on `rows` of `global_rows`."""
        self.active = True
        self.to_owners = to_owners and self.owners
        self.metrics_updated = False
        self.rows = rows
        self.weight = None if global_rows is None else rows / global_rows

    def _on_grad(self, param):
        if not self.active:
            return
        if not self.queued:
            # As DDP: `.grad` is global once backward completes.
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish
            )
            self._arm_tail()
        index, view = self.slot[id(param)]
        # Each rank's loss is a mean over its rows: weight by rows.
        scale = float(self.rows) if self.weight is None else self.weight
        if scale:
            torch.mul(param.grad, scale, out=view)
        else:  # no rows: nothing (a mean over none is NaN)
            view.zero_()
        param.grad = view
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            self._launch(index)

    def _arm_tail(self):
        """The step's other sums: the last bucket's tail, or alone."""
        model = self.model()
        states = EarlyMetrics.states_of(model, self.metrics_updated)
        self.early = None
        if states:
            frozen = getattr(state_of(model, create=False), "frozen", None)
            self.early = EarlyMetrics(states, frozen)
        parts = [] if self.early is None else [self.early.flat]
        if self.weight is None:  # per-process rows: sum them too
            parts.append(torch.tensor([float(self.rows)], dtype=torch.float64))
        if not parts:
            return
        width = max(s.element_size() for s in states) if states else 4
        exact = self.tail_width >= width and all(
            s.is_floating_point() for s in states
        )
        if self.to_owners or not exact:
            if self.early is not None:
                self.early.launch()
            if self.weight is None:
                self.total_rows = parts[-1]
                self.rows_work = dist.all_reduce(self.total_rows, async_op=True)
            return
        tail = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tail.numel() > self.tail_room:  # no gradient is in yet
            self._allocate(tail.numel())
        self.tail = tail

    def _launch(self, index):
        if not self.to_owners:
            n = self.sizes[index]
            last = len(self.works) == len(self.buckets) - 1
            if last and self.tail is not None:
                n += self.tail.numel()
                self.buffers[index][self.sizes[index] : n].copy_(self.tail)
                self.tail_at = index
            self.works[index] = dist.all_reduce(
                self.buffers[index][:n], async_op=True
            )
            return
        buffer, ops = self.buffers[index], []
        for owner, (start, stop) in self.segments[index].items():
            if owner != self.rank and stop > start:
                ops.append(
                    dist.P2POp(dist.isend, buffer[start:stop], owner, tag=index)
                )
        for peer, inbox in self.inbox[index]:
            ops.append(dist.P2POp(dist.irecv, inbox, peer, tag=index))
        self.works[index] = dist.batch_isend_irecv(ops) if ops else []

    def finish(self):
        """Completes every bucket's reduction; `.grad` holds the result."""
        if not self.works and not any(self.ready):
            return
        for index, bucket in enumerate(self.buckets):
            if index in self.works:
                continue
            for p in bucket:  # no gradient (yet): a zero contribution
                if p.grad is not self.slot[id(p)][1]:
                    self.slot[id(p)][1].zero_()
            self._launch(index)
        if self.rows_work is not None:
            self.rows_work.wait()
        for index, work in sorted(self.works.items()):
            if not isinstance(work, list):
                work.wait()
                continue
            for w in work:
                w.wait()
            start, stop = self.segments[index].get(self.rank, (0, 0))
            for _, inbox in self.inbox[index]:
                self.buffers[index][start:stop].add_(inbox)
        if self.tail_at is not None:
            n = self.sizes[self.tail_at]
            tail = self.buffers[self.tail_at][n : n + self.tail.numel()]
            tail = tail.double()
            if self.early is not None:
                self.early.received(tail[: self.early.flat.numel()])
            if self.weight is None:
                self.total_rows = tail[-1:]
        for index in sorted(self.works):
            if self.total_rows is not None:
                self.buffers[index][: self.sizes[index]].div_(
                    float(self.total_rows)
                )
            for p in self.buckets[index]:
                p.grad = self.slot[id(p)][1]
        self._reset()

    def remove(self):
        for handle in self.handles:
            handle.remove()
