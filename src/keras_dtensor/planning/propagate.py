"""Whether one region can run split over the model axis, op by op.

A choice per producer is carried through the region's ops in execution
order, as DTensor carries a `Shard(dim)`, to the consumers' contracted
dims; anything else is a `Conflict` naming the op. A split is `(dim,
block, period)`: index `i` along `dim` is on rank `(i // block) % parts`.
"""

import collections
import math

from keras_dtensor.planning.dataflow import CONTRACTIONS
from keras_dtensor.planning.dataflow import IDENTITY
from keras_dtensor.planning.dataflow import contraction
from keras_dtensor.planning.trace import nbytes

__all__ = ["Conflict", "Split", "propagate"]


class Conflict(Exception):  # noqa: N818 (a verdict, not an error)
    """The split cannot pass an op; the message says where and why."""


PARTIAL = "partial"
SHAPE_ONLY = IDENTITY | {"empty_like", "dropout", "native_dropout", "copy"}
REDUCTIONS = {
    "mean",
    "sum",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "prod",
    "logsumexp",
    "argmax",
    "argmin",
    "all",
    "any",
    "norm",
    "linalg_vector_norm",
}
ALONG = {"softmax", "log_softmax", "safe_softmax", "cumsum", "topk", "sort"}
CUTS = {
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "slice",
    "select",
    "narrow",
    "flip",
    "roll",
}
ELEMENTWISE = {"where", "masked_fill", "clamp", "lerp"}
ATTENTION = {
    "scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_efficient_attention",
    "scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention_math",
}


def _fail(node, why):
    raise Conflict(f"aten.{node.op}: {why}")


def _pos(dim, ndim):
    return dim % ndim if ndim else 0


def _atom_split(atoms, j, parts):
    """`(block, period)` of splitting atom `j` of a dim into `parts`."""
    period = atoms[j][1] * math.prod(size for _, size, _ in atoms[j + 1 :])
    return period // parts, period


def _through_view(node, split, shape_in, shape_out):
    """A split of a view's input, on its output."""
    d, block, period = split
    inner = math.prod(shape_in[d + 1 :])
    block, period = block * inner, period * inner  # in elements
    for o in range(len(shape_out)):
        below, span = math.prod(shape_out[o + 1 :]), math.prod(shape_out[o:])
        if shape_out[o] > 1 and block % below == 0 and span % period == 0:
            return (o, block // below, period // below)
    shapes = f"{tuple(shape_in)} to {tuple(shape_out)}"
    _fail(node, f"a view of {shapes} spreads the split dim {d} over two dims")


# A region run split: path -> `(variable, dim, role)`, all-reduces forward
# and backward, and the bytes of the weights it splits.
Split = collections.namedtuple("Split", "weights forward backward nbytes")


def _with_dim(split, d):
    return (d, split[1], split[2])


class _Run:
    def __init__(self, flow, parts):
        self.flow, self.parts = flow, parts
        self.shapes = flow.trace.shapes
        self.by_node = {p.index: p for p in flow.projections}
        self.split = {}  # tensor id -> (dim, block, period) or PARTIAL
        self.weights = {}
        self.forward = 0
        self.column_inputs = set()

    def weight(self, tid, tensor_dim, split, role, node):
        """Split weight view `tid` where its dim `tensor_dim` is split."""
        var, dims = self.flow.views[tid]
        self.place(var, dims[tensor_dim], split, role, node, "a weight dim")

    def place(self, var, atoms, split, role, node, what="a dim"):
        """Split `var` on the atom of `atoms` that `split` cuts."""
        parts = self.parts
        for j, (_, size, _) in enumerate(atoms):
            if size % parts == 0 and _atom_split(atoms, j, parts) == split[1:]:
                return self.weight_atom(var, atoms[j], role, node)
        _fail(node, f"{var.path}: the split falls inside {what}")

    def weight_atom(self, var, atom, role, node):
        var_dim, _, outer = atom
        size = var.shape[var_dim]
        if not outer:
            _fail(node, f"{var.path}: the split falls inside dim {var_dim}")
        if size % self.parts:
            why = f"dim {var_dim} of {size} does not divide by {self.parts}"
            _fail(node, f"{var.path} {why}")
        old = self.weights.get(var.path)
        if old is not None and old[1] != var_dim:
            _fail(node, f"{var.path} split on two dims")
        if old is None or role in ("column", "row"):
            self.weights[var.path] = (var, var_dim, role)

    def get(self, tid):
        d = self.split.get(tid)
        return None if d is PARTIAL else d

    # -- ops ----------------------------------------------------------
    def elementwise(self, node, ins, outs):
        nd = len(self.shapes[outs[0]])
        target = None
        for i in ins:
            sp = self.get(i)
            if sp is not None:
                aligned = _with_dim(sp, sp[0] + nd - len(self.shapes[i]))
                if target not in (None, aligned):
                    _fail(node, "operands split unlike")
                target = aligned
        for i in ins:
            own = target[0] - (nd - len(self.shapes[i]))
            if self.get(i) is not None or own < 0 or self.shapes[i][own] == 1:
                continue  # split already, or broadcast along the split dim
            if i in self.flow.views:  # else each rank uses its part
                self.weight(i, own, target, "alongside", node)
        for o in outs:
            if len(self.shapes[o]) == nd:
                self.split[o] = target

    def reduce(self, node, i, outs, dims, keep):
        sp = self.get(i)
        nd = len(self.shapes[i])
        dims = [_pos(x, nd) for x in dims] if dims else list(range(nd))
        if sp[0] in dims:
            if node.op != "sum":
                _fail(node, "reduces over the split dim")
            self.split[outs[0]] = PARTIAL  # a sum of parts: one all-reduce
            self.forward += 1
            return
        out = sp[0] if keep else sp[0] - sum(1 for x in dims if x < sp[0])
        self.split[outs[0]] = _with_dim(sp, out)

    def contract(self, node):
        c = contraction(node)
        p = self.by_node.get(self.index)
        sa, sb = self.get(c.a), self.get(c.b)
        na, nb = len(self.shapes[c.a]), len(self.shapes[c.b])
        da = None if sa is None else sa[0]
        db = None if sb is None else sb[0]
        batch = 0 if c.batched else None
        if p is not None:
            act = sa if p.kernel_on_right else sb
            contracted = na - 1 if p.kernel_on_right else nb - 2
            if act[0] == contracted:  # a consumer: rows, a partial sum
                self.place(p.var, p.contracted, act, "row", node)
                out = PARTIAL
            elif act[0] == batch:  # batched experts
                self.place(p.var, p.batch, act, "experts", node)
                out = act
            else:
                _fail(node, f"feeds {p.var.path} on a dim it does not contract")
        elif batch is not None and (da, db) in ((0, 0), (0, None), (None, 0)):
            if sa is not None and sb is not None and sa != sb:
                _fail(node, "a batched contraction of operands split unlike")
            out = sa or sb
        elif da == na - 1 and db == nb - 2 and sa[1:] == sb[1:]:
            out = PARTIAL
        elif sb is None and da == na - 2:
            out = sa
        elif sa is None and db == nb - 1:
            out = _with_dim(sb, len(self.shapes[c.out]) - 1)
        else:
            _fail(node, "a contraction of split operands on other dims")
        self.split[c.out] = out
        if out is PARTIAL:  # one all-reduce
            self.forward += 1

    def step(self, node):
        ins = [i for i in node.inputs if isinstance(i, int)]
        if node.op in ("cat", "stack") and isinstance(node.inputs[0], tuple):
            ins = list(node.inputs[0])
        if not any(self.get(i) is not None for i in ins):
            return
        outs = [o for o in node.outputs if isinstance(o, int)]
        if not outs:  # a query (`prim.device`, sizes): nothing to carry
            return
        op, args, first = node.op, node.args, node.inputs[0]
        if op.endswith("_like") or op in ("arange", "full", "scalar_tensor"):
            return  # reads a shape or dtype, not the values
        if op in CONTRACTIONS:
            return self.contract(node)
        if op in SHAPE_ONLY:
            self.split[outs[0]] = self.get(first)
            return
        if (node.pointwise and len(outs) == 1) or op in ELEMENTWISE:
            return self.elementwise(node, ins, outs)
        sp = self.get(first) if isinstance(first, int) else None
        if sp is None and op not in ("cat", "stack"):
            _fail(node, "a split operand in a place no rule covers")
        if op in REDUCTIONS:
            dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            keep = (
                bool(args[2])
                if len(args) > 2 and isinstance(args[2], bool)
                else bool(node.kwargs.get("keepdim", False))
            )
            return self.reduce(node, first, outs, dims, keep)
        shape_in = self.shapes[first] if isinstance(first, int) else None
        if op in ALONG:
            if sp[0] == _pos(args[1], len(shape_in)):
                _fail(node, "runs along the split dim")
            for o in outs:
                if len(self.shapes[o]) == len(shape_in):
                    self.split[o] = sp
            return
        if op in CUTS:
            if op in ("flip", "roll"):
                along = args[1]
            else:
                along = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
            along = [along] if isinstance(along, int) else list(along)
            along = [_pos(a, len(shape_in)) for a in along]
            if sp[0] in along:
                _fail(node, "cuts along the split dim")
            drop = op in ("select", "unbind")
            d = sp[0] - (drop and along[0] < sp[0])
            for o in outs:
                self.split[o] = _with_dim(sp, d)
            return
        out = self.shapes[outs[0]]
        if op == "native_layer_norm":
            if sp[0] >= len(shape_in) - len(args[1]):
                _fail(node, "normalizes over the split dim")
        elif op in ATTENTION:
            q, k, v = node.inputs[:3]
            if not (self.get(q) == self.get(k) == self.get(v) and sp[0] < 2):
                _fail(node, "attention with q, k, v split unlike")
        elif op in ("view", "unsafe_view", "reshape", "squeeze"):
            sp = _through_view(node, sp, shape_in, out)
        elif op == "expand":
            sp = _with_dim(sp, sp[0] + len(out) - len(shape_in))
        elif op == "permute":
            sp = _with_dim(sp, list(args[1]).index(sp[0]))
        elif op in ("transpose", "t"):
            pair = (0, 1) if op == "t" else args[1:3]
            d0, d1 = (_pos(x, len(shape_in)) for x in pair)
            sp = _with_dim(sp, {d0: d1, d1: d0}.get(sp[0], sp[0]))
        elif op == "unsqueeze":
            u = _pos(args[1], len(shape_in) + 1)
            sp = _with_dim(sp, sp[0] + (u <= sp[0]))
        elif op in ("cat", "stack"):
            nd = len(self.shapes[first[0]])
            along = _pos(args[1] if len(args) > 1 else 0, nd + (op == "stack"))
            splits = {self.get(t) for t in first} - {None}
            if len(splits) != 1:
                _fail(node, "joins operands split unlike")
            sp = splits.pop()
            if op == "cat" and along == sp[0]:
                _fail(node, "concatenates along the split dim")
            sp = _with_dim(sp, sp[0] + (op == "stack" and along <= sp[0]))
        else:
            _fail(node, "no rule for a split operand")
        self.split[outs[0]] = sp

    def run(self, choices):
        nodes = self.flow.trace.nodes
        starts = {}
        for p, (out_dim, atoms, j) in choices.items():
            self.weight_atom(p.var, atoms[j], "column", nodes[p.index])
            block, period = _atom_split(atoms, j, self.parts)
            starts[p.index] = (out_dim, block, period)
            self.column_inputs.add(self.flow.base(p.activation))
        for self.index, node in enumerate(nodes):
            start = starts.get(self.index)
            if start is None:
                self.step(node)
                continue
            p = self.by_node[self.index]
            self.split[p.out] = start
            if p.bias in self.flow.views:
                nd = len(self.shapes[p.bias])
                self.weight(p.bias, nd - 1, start, "alongside", node)
        if any(self.get(o) is not None for o in self.flow.trace.outputs):
            raise Conflict("the split reaches the model's output")
        size = sum(nbytes(v) for v, _, _ in self.weights.values())
        backward = len(self.column_inputs)
        return Split(self.weights, self.forward, backward, size)


def propagate(flow, parts, choices) -> Split:
    """Carries `choices` (producer -> `(output dim, atoms, atom index)`)
    through their region; raises `Conflict`."""
    return _Run(flow, parts).run(choices)
