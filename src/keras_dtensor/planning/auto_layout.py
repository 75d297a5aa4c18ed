"""`keras_dtensor.auto_layout_map`: a LayoutMap derived from the model.

The model's dataflow (`trace`, `dataflow`, `propagate`), not its variable
names, gives each weight's layout: split regions as Megatron-LM's pairs,
embeddings by vocabulary or hidden dim, everything else replicated with
the reason. The same on every rank and every run, with no communication.
"""

import collections
import dataclasses
import itertools
import math
import re

from keras_dtensor.backend.layout import local_shape
from keras_dtensor.backend.layout import normalize_axes
from keras_dtensor.planning import dataflow
from keras_dtensor.planning import propagate
from keras_dtensor.planning import trace as tracing

__all__ = ["AutoLayout", "auto_layout", "auto_layout_map"]

_MAX_TRIES = 256
_LARGE_EMBEDDING = 2**20

# One weight: its layout axes and why.
Entry = collections.namedtuple("Entry", "path shape axes why")


@dataclasses.dataclass
class AutoLayout:
    """What `auto_layout` decided: `entries` per weight, collectives per
    training step, and the `layout_map`."""

    entries: list
    mesh: object
    model_axis: str
    batch_axis: str
    all_reduces_forward: int
    all_reduces_backward: int
    all_gathers_forward: int
    layout_map: object
    bytes_full: int
    bytes_per_rank: int

    def table(self) -> str:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape, strict=True))
        lines = [
            f"auto layout over {self.model_axis!r} ({sizes[self.model_axis]} "
            f"ranks) of mesh {dict(sizes)}",
            "| weight | shape | axes | why |",
            "|---|---|---|---|",
            *(
                f"| {e.path} | {e.shape} | {e.axes} | {e.why} |"
                for e in self.entries
            ),
            "collectives per training step (model axis): "
            f"{self.all_reduces_forward} all-reduces forward, "
            f"{self.all_reduces_backward} backward, "
            f"{self.all_gathers_forward} all-gathers forward",
            f"weights per rank: {self.bytes_per_rank / 2**20:.2f} MiB of "
            f"{self.bytes_full / 2**20:.2f} MiB",
        ]
        return "\n".join(lines)

    __str__ = table


def _options(flow, p, fixed, parts):
    """A producer's `(output dim, atoms, index)` choices, then None."""
    if p.var.path in fixed:
        return [None]
    nd = len(flow.trace.shapes[p.out])
    free_dim = nd - 1 if p.kernel_on_right else nd - 2
    out = []
    for dim, atoms in ((free_dim, p.free), (0, p.batch)):
        for j, (_, size, outer) in enumerate(atoms):
            if outer and size % parts == 0:
                out.append((dim, atoms, j))
    return [*out, None]


def _split_region(flow, root, parts, fixed, min_bytes):
    producers = flow.producers(root)
    if not producers:
        return None, None
    first_reason = None
    options = [_options(flow, p, fixed, parts) for p in producers]
    open_ = [p for p in producers if p.var.path not in fixed]
    if open_ and all(o == [None] for o in options):
        p = open_[0]
        sizes = [size for _, size, _ in (*p.batch, *p.free)]
        return None, (
            f"{p.var.path}: its output dims {sizes} do not divide by {parts}"
        )
    combos = itertools.islice(itertools.product(*options), _MAX_TRIES * 4)
    ranked = sorted(combos, key=lambda c: sum(x is None for x in c))
    for combo in ranked[:_MAX_TRIES]:
        if all(c is None for c in combo):
            break
        choices = {p: c for p, c in zip(producers, combo, strict=True) if c}
        try:
            split = propagate.propagate(flow, parts, choices)
        except propagate.Conflict as conflict:
            first_reason = first_reason or str(conflict)
            continue
        if any(path in fixed for path in split.weights):
            first_reason = first_reason or "its weights are split elsewhere"
            continue
        if split.nbytes < min_bytes:
            return None, f"{split.nbytes} bytes, under min_shard_bytes"
        return split, None
    return None, first_reason


def _embedding(var, parts, tied):
    vocab, hidden = var.shape[0], var.shape[-1]
    if (tied or tracing.nbytes(var) >= _LARGE_EMBEDDING) and vocab % parts == 0:
        why = "tied to the output head" if tied else "large"
        return 0, f"embedding by vocabulary ({why}): one all-reduce"
    if hidden % parts == 0:
        return len(var.shape) - 1, "embedding by hidden dim: one all-gather"
    return None, f"embedding: neither {vocab} nor {hidden} divide by {parts}"


def _reaches_output(flow, p):
    """Whether `p`'s output reaches a model output unmixed."""
    live = {p.out}
    for node in flow.trace.nodes:
        if any(i in live for i in node.inputs) and (
            node.pointwise or node.op in ("view", "unsafe_view", "to_copy")
        ):
            live.update(o for o in node.outputs if isinstance(o, int))
    return bool(live & flow.trace.outputs)


def auto_layout(
    build,
    mesh,
    *,
    model_axis="model",
    batch_axis="batch",
    fsdp=False,
    sample_input=None,
    min_shard_bytes=0,
):
    """Derives the layout of every weight of `build()`'s model over
    `mesh`'s `model_axis` from the model's dataflow.

    Args:
        build: a function of no arguments that creates the model (run
            once on torch's `meta` device, with fake tensors), or a model.
        mesh: the `keras.distribution.DeviceMesh` to lay weights out on.
        model_axis: the mesh axis weights are split over.
        batch_axis: the mesh axis the batch is split over.
        fsdp: also split each weight over `batch_axis` (FSDP-style), on
            its largest dim that axis divides.
        sample_input: inputs for one call, for a model without symbolic
            inputs (subclassed); a functional model's own are used.
        min_shard_bytes: leave a region whole whose split weights are
            smaller than this.

    Returns:
        An `AutoLayout`: `print()` it for each weight's layout and why, the
        collectives per training step and the bytes per rank;
        `.layout_map` is the `keras.distribution.LayoutMap`.
    """
    import keras

    names = list(mesh.axis_names)
    for axis in (model_axis, *((batch_axis,) if fsdp else ())):
        if axis not in names:
            raise ValueError(
                f"auto_layout: the mesh has no axis {axis!r}; its axes are "
                f"{names} (pass model_axis=/batch_axis=)"
            )
    sizes = dict(zip(names, mesh.shape, strict=True))
    model, trace = tracing.record(build, sample_input)
    decided, counts = _decide(
        dataflow.analyze(trace), sizes[model_axis], min_shard_bytes
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    entries, full, per_rank = [], 0, 0
    data = sizes.get(batch_axis, 1)
    for var in model.weights:
        dim, why = decided.get(var.path, (None, None))
        axes = [None] * len(var.shape)
        if dim is not None:
            axes[dim] = model_axis
        if fsdp and data > 1 and tracing.nbytes(var) >= max(min_shard_bytes, 1):
            free = [d for d, a in enumerate(axes) if a is None]
            free = [d for d in free if var.shape[d] % data == 0]
            if free:
                d = max(free, key=lambda d: var.shape[d])
                axes[d] = batch_axis
                why = (why + "; " if why else "") + f"FSDP: dim {d} by batch"
        if why is None:
            why = (
                "replicated: not a projection's weight"
                if len(var.shape) < 2
                else "replicated: used by no projection the axis can split"
            )
        elif dim is None and "FSDP" not in why:
            why = "replicated, " + why
        local = local_shape(var.shape, normalize_axes(axes), sizes)
        full += tracing.nbytes(var)
        per_rank += math.prod(local) * tracing.keras_itemsize(var.dtype)
        if any(axes):
            layout_map["^" + re.escape(var.path) + "$"] = tuple(axes)
        entries.append(Entry(var.path, tuple(var.shape), tuple(axes), why))
    return AutoLayout(
        entries,
        mesh,
        model_axis,
        batch_axis,
        *counts,
        layout_map,
        full,
        per_rank,
    )


def _decide(flow, parts, min_bytes):
    """`(path -> (dim or None, why), collective counts)` over `parts`."""
    decided = {}  # path -> (dim or None, why)
    fwd = bwd = gathers = 0
    tied = {p.var.path for p in flow.projections}
    vocab_split = set()
    for var in flow.embeddings:
        if var.path in decided:
            continue
        dim, why = _embedding(var, parts, var.path in tied)
        decided[var.path] = (dim, why)
        if dim == 0:
            fwd += 1
            vocab_split.add(var.shape[0])
            gathers += var.path in tied  # logits split by vocabulary
        elif dim is not None:
            gathers += 1
    if parts > 1:
        fixed = {k for k, (d, _) in decided.items() if d is not None}
        found = []
        for root in flow.regions:
            split, reason = _split_region(flow, root, parts, fixed, min_bytes)
            if split is None:
                for p in (*flow.producers(root), *flow.consumers(root)):
                    if reason and decided.get(p.var.path, (None,))[0] is None:
                        decided[p.var.path] = (None, f"whole: {reason}")
                continue
            found.append(split)
        # A weight belongs to one split region (`_plan`).
        taken = {}
        for split in _plan(sorted(found, key=lambda s: -s.nbytes)):
            shared = sorted(set(split.weights) & set(taken))
            if shared:
                why = f"whole: {shared[0]} is split with {taken[shared[0]]}"
                for path in split.weights:
                    decided.setdefault(path, (None, why))
                continue
            fwd += split.forward
            bwd += split.backward
            label = _label(split)
            for path, (_, dim, role) in split.weights.items():
                taken[path] = label
                decided[path] = (dim, f"{role}, {label}")
        for p in flow.projections:
            if decided.get(p.var.path, (None,))[0] is not None or not p.free:
                continue
            dim, size, outer = p.free[0]
            if outer and size in vocab_split and _reaches_output(flow, p):
                why = "output head by vocabulary, as its embedding"
                decided[p.var.path] = (dim, why)
                gathers += 1
    return decided, (fwd, bwd, gathers)


def _compatible(splits):
    """`splits` in order, less those sharing a weight with one before."""
    kept, seen = [], set()
    for split in splits:
        if seen.isdisjoint(split.weights):
            kept.append(split)
            seen.update(split.weights)
    return kept


def _plan(splits):
    """`splits` (largest first) as kept by the best start region (more
    bytes sharded, then fewer all-reduces; the first on a tie), then the
    rest (the residual stream against Megatron's pairs)."""
    best = max(
        (
            _compatible([first, *splits[:i], *splits[i + 1 :]])
            for i, first in enumerate(splits)
        ),
        key=lambda plan: (
            sum(s.nbytes for s in plan),
            -sum(s.forward + s.backward for s in plan),
        ),
        default=[],
    )
    chosen = {id(s) for s in best}
    return best + [s for s in splits if id(s) not in chosen]


def _label(split):
    """`up+gate -> down`: the layers split by columns, then by rows."""
    layers = collections.defaultdict(set)
    for v, _, role in split.weights.values():
        if role != "alongside":
            layers[role].add(v.path.rsplit("/", 2)[-2])
    rows = sorted(layers["row"]) + sorted(layers["experts"])
    return f"{'+'.join(sorted(layers['column']))} -> {'+'.join(rows) or 'sum'}"


def auto_layout_map(build, mesh, **options):
    """A `keras.distribution.LayoutMap` for any model, from its dataflow.

    Args:
        build, mesh, **options: as `auto_layout` takes them (`model_axis`,
            `batch_axis`, `fsdp`, `sample_input`, `min_shard_bytes`).

    Returns:
        A LayoutMap for `keras.distribution.ModelParallel`; the same on
        every rank and every run. `auto_layout` (same arguments) says
        why each weight got its layout.

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"])
    layout_map = keras_dtensor.auto_layout_map(build_model, mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    ```
    """
    return auto_layout(build, mesh, **options).layout_map
