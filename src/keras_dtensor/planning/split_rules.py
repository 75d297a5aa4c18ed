"""The pieces `propagate` carries a split with: op families, and how a
split `(dim, block, period)` (the index along `dim` cut as
`(index // block) % parts`, `period` = `block * parts`) passes a view or
meets a weight's atoms."""

import math

from keras_dtensor.planning.dataflow import IDENTITY

__all__ = [
    "ALONG",
    "ATTENTION",
    "CUTS",
    "PARTIAL",
    "REDUCTIONS",
    "SHAPE_ONLY",
    "Conflict",
    "atom_split",
    "fail",
    "matching_atom",
    "pos",
    "through_view",
]


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
ATTENTION = {
    "scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_efficient_attention",
    "scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention_math",
}


def fail(node, why):
    raise Conflict(f"aten.{node.op}: {why}")


def pos(dim, ndim):
    return dim % ndim if ndim else 0


def atom_split(atoms, j, parts):
    """`(block, period)` of splitting atom `j` of a dim into `parts`."""
    stride = 1
    for _, size, _ in atoms[j + 1 :]:
        stride *= size
    period = atoms[j][1] * stride
    return period // parts, period


def matching_atom(atoms, block, period, parts):
    """The atom of a weight dim split as `(block, period)`, or None."""
    for j in range(len(atoms)):
        if atoms[j][1] % parts == 0 and atom_split(atoms, j, parts) == (
            block,
            period,
        ):
            return j
    return None


def through_view(node, split, shape_in, shape_out):
    """A split `(dim, block, period)` of a view's input, on its output:
    the index along `dim` is cut as `(index // block) % parts`."""
    d, block, period = split
    inner = math.prod(shape_in[d + 1 :])
    block, period = block * inner, period * inner  # in elements
    for o in range(len(shape_out)):
        below, span = math.prod(shape_out[o + 1 :]), math.prod(shape_out[o:])
        if shape_out[o] > 1 and block % below == 0 and span % period == 0:
            return (o, block // below, period // below)
    fail(
        node,
        f"a view of {tuple(shape_in)} to {tuple(shape_out)} spreads the "
        f"split dim {d} over two dims",
    )
    return None
