"""A recorded forward pass read as projections and the regions between them.

*Weight views* hold variable dims as atoms `(var_dim, size, outer)`;
*projections* contract an activation with a weight view; *regions* join
the activations between projections (docs/internals/planning.md).
"""

import collections
import dataclasses

__all__ = ["IDENTITY", "Contraction", "Dataflow", "analyze", "contraction"]

IDENTITY = {
    "detach",
    "lift_fresh",
    "lift_fresh_copy",
    "clone",
    "to_copy",
    "alias",
    "contiguous",
    "type_as",
}
_VIEWS = IDENTITY | {
    "view",
    "unsafe_view",
    "reshape",
    "permute",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "expand",
}
CONTRACTIONS = {"mm", "bmm", "addmm", "baddbmm"}


# `out = bias + a @ b` with `a` `[B?, m, k]` and `b` `[B?, k, n]`.
Contraction = collections.namedtuple("Contraction", "a b bias out batched")


def contraction(node):
    """The `Contraction` of a `CONTRACTIONS` node."""
    if node.op in ("mm", "bmm"):
        a, b, bias = node.inputs[0], node.inputs[1], None
    else:
        bias, a, b = node.inputs[0], node.inputs[1], node.inputs[2]
    return Contraction(a, b, bias, node.outputs[0], node.op.endswith("bmm"))


@dataclasses.dataclass(eq=False)
class Projection:
    """A contraction of an activation with a weight view."""

    index: int  # of the node
    var: object
    activation: int
    out: int
    kernel_on_right: bool
    free: tuple  # atoms of the kernel's output dim
    contracted: tuple  # atoms of the kernel's contracted dim
    batch: tuple  # atoms of the kernel's batch dim (bmm), else ()
    bias: int | None


@dataclasses.dataclass
class Dataflow:
    trace: object
    views: dict  # tensor id -> (variable, [atoms per dim])
    projections: list
    embeddings: list  # variables an `embedding` op reads
    regions: dict  # root -> set of tensor ids
    region_of: dict  # tensor id -> root
    parent: dict  # tensor id -> the tensor it is a view or copy of

    def base(self, tid):
        """The tensor `tid` is a view or copy of."""
        while tid in self.parent:
            tid = self.parent[tid]
        return tid

    def producers(self, root):
        return [
            p for p in self.projections if self.region_of.get(p.out) == root
        ]

    def consumers(self, root):
        return [
            p
            for p in self.projections
            if self.region_of.get(p.activation) == root
        ]


def _regroup(dims, shape):
    """The atoms of a weight view viewed as `shape`, or None (uneven)."""
    queue = [atom for dim in dims for atom in dim if atom[1] > 1]
    out = []
    for size in shape:
        if size == 1:
            out.append(())
            continue
        need, group = size, []
        while need > 1:
            if not queue:
                return None
            var_dim, n, outer = queue.pop(0)
            take = min(n, need)
            if need % take or n % take:
                return None
            group.append((var_dim, take, outer))
            if n > take:  # the inner rest of the dim comes next
                queue.insert(0, (var_dim, n // take, False))
            need //= take
        out.append(tuple(group))
    return out if not queue else None


def _view_of(node, dims, shapes):
    """Atoms of a shape op's output given its input's, or None."""
    op, args = node.op, node.args
    if node.op in IDENTITY or node.pointwise:  # its one tensor input
        return list(dims)
    if op == "permute":
        return [dims[i] for i in args[1]]
    if op == "t":
        return list(reversed(dims))
    if op == "transpose":
        d0, d1 = (d % len(dims) for d in args[1:3])
        out = list(dims)
        out[d0], out[d1] = out[d1], out[d0]
        return out
    if op == "unsqueeze":
        d = args[1] % (len(dims) + 1)
        return [*dims[:d], (), *dims[d:]]
    if op in ("view", "unsafe_view", "reshape", "squeeze", "expand"):
        return _regroup(dims, shapes[node.outputs[0]])
    return None


def _projection(index, node, views):
    c = contraction(node)
    left, right = views.get(c.a), views.get(c.b)
    if (left is None) == (right is None):
        return None
    on_right = right is not None
    var, dims = right if on_right else left
    free, contracted = (
        (dims[-1], dims[-2]) if on_right else (dims[-2], dims[-1])
    )
    activation = c.a if on_right else c.b
    batch = dims[0] if c.batched else ()
    return Projection(
        index, var, activation, c.out, on_right, free, contracted, batch, c.bias
    )


def _root(union, x):
    """The root of `x`'s region in the union-find forest `union`."""
    while union.setdefault(x, x) != x:
        union[x] = union[union[x]]
        x = union[x]
    return x


def analyze(trace) -> Dataflow:
    """Weight views, projections, embeddings and regions of `trace`."""
    views = {
        tid: (var, [((d, n, True),) for d, n in enumerate(var.shape)])
        for tid, var in trace.weights.items()
    }
    projections, embeddings = [], []
    stream, union = set(), {}
    parent = {}
    order = {}  # first appearance of a tensor, for deterministic roots

    for index, node in enumerate(trace.nodes):
        outs = [o for o in node.outputs if isinstance(o, int)]
        for o in outs:
            order.setdefault(o, len(order))
        single = [i for i in node.inputs if isinstance(i, int)]
        out = node.outputs[0] if node.outputs else None
        if len(single) == 1 and single[0] in views and isinstance(out, int):
            var, dims = views[single[0]]
            view = _view_of(node, dims, trace.shapes)
            if view is not None and len(view) == len(trace.shapes[out]):
                views[out] = (var, view)  # a weight view, for later nodes
        if node.op in CONTRACTIONS:
            p = _projection(index, node, views)
            if p is not None:
                projections.append(p)
                stream.add(p.out)
                continue
        if node.op == "embedding" and node.inputs[0] in views:
            embeddings.append(views[node.inputs[0]][0])
            stream.add(outs[0])
            continue
        tensors = [
            x
            for i in node.inputs
            for x in (i if isinstance(i, tuple) else (i,))
            if isinstance(x, int)
        ]
        if len(tensors) == len(outs) == 1 and node.op in _VIEWS:
            parent[outs[0]] = tensors[0]
        ins = [i for i in tensors if i in stream and i not in views]
        if ins and not node.op.endswith("_like"):  # values unread
            live = [*ins, *(o for o in outs if o not in views)]
            stream.update(live)
            for other in live[1:]:
                a, b = _root(union, live[0]), _root(union, other)
                union[max(a, b)] = min(a, b)
    regions, region_of = {}, {}
    for tid in sorted(stream, key=lambda t: order.get(t, -1)):
        root = _root(union, tid)
        regions.setdefault(root, set()).add(tid)
        region_of[tid] = root
    return Dataflow(
        trace, views, projections, embeddings, regions, region_of, parent
    )
