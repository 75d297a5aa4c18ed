"""One forward pass of a model recorded as aten ops, on the `meta` device.

The model is built and called where nothing is allocated (torch's `meta`
device, fake tensors); one whose build or call needs values falls back to
the CPU with a warning naming the layer.
"""

import collections
import contextlib
import copy
import math
import os
import re
import traceback
import warnings

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from keras_dtensor import compat

__all__ = ["Node", "Trace", "build_on", "record"]


# One aten op (`"mm"`): tensor arguments and outputs as ids (`None` for
# other arguments, kept in `args`, `kwargs`).
Node = collections.namedtuple("Node", "op pointwise inputs args kwargs outputs")
# `nodes` in execution order, `shapes` and `weights` (variables) by id;
# `keep` holds the tensors so their ids stay unique.
Trace = collections.namedtuple("Trace", "nodes shapes weights outputs keep")


class _Recorder(TorchDispatchMode):
    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def _id(self, value):
        if isinstance(value, Tensor):
            self.trace.keep.append(value)  # ids stay unique while recorded
            self.trace.shapes.setdefault(id(value), tuple(value.shape))
            return id(value)
        return None

    def _ids(self, arg):
        """A tensor's id, a tuple of ids for a list holding tensors."""
        if isinstance(arg, (list, tuple)) and any(
            isinstance(x, Tensor) for x in arg
        ):
            return tuple(self._id(x) for x in arg)
        return self._id(arg)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        packet = getattr(func, "overloadpacket", None)
        node = Node(
            str(func) if packet is None else packet.__name__.lstrip("_"),
            torch.Tag.pointwise in getattr(func, "tags", ()),
            tuple(self._ids(a) for a in args),
            tuple(None if isinstance(a, Tensor) else a for a in args),
            {k: v for k, v in kwargs.items() if not isinstance(v, Tensor)},
            tuple(self._id(o) for o in outs),
        )
        self.trace.nodes.append(node)
        return out


def _sample_value(spec, batch=2, length=8):
    import keras

    shape = [batch] + [length if d is None else d for d in spec.shape[1:]]
    dtype = keras.backend.standardize_dtype(spec.dtype)
    fill = torch.ones if "int" in dtype or dtype == "bool" else torch.zeros
    return fill(shape, dtype=getattr(torch, dtype), device="cpu")


def build_on(build, device):
    """`build()` run under Keras's `device` scope; a model as it is."""
    import keras

    if isinstance(build, keras.Model):
        return build
    with compat.torch_core().device_scope(device):
        return build()


def _trace_call(model, sample_input, fake):
    """Calls `model` once, statelessly, on values whose ids are known:
    fake CPU tensors (shapes only) when `fake`, else copies of its own."""
    import keras
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = contextlib.nullcontext()
    if fake:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, compat.torch_core().device_scope("cpu"):
        trainable = len(model.trainable_variables)
        variables = [*model.trainable_variables, *model.non_trainable_variables]
        values = [  # plain tensors: Keras keeps their identity
            torch.empty(tuple(v.shape), dtype=v.value.dtype)
            if fake
            else v.value.detach().clone()
            for v in variables
        ]
        if sample_input is None:  # like `model.input`: unknown dims 2, 8
            try:
                specs = model.input
            except (AttributeError, ValueError):
                specs = None
            if specs is None:
                raise ValueError(
                    f"model {model.name!r} has no symbolic inputs (a "
                    "subclassed model): pass `sample_input=` to auto_layout"
                )
            inputs = keras.tree.map_structure(_sample_value, specs)
        else:
            inputs = keras.tree.map_structure(torch.as_tensor, sample_input)
        keep = [*values, *keras.tree.flatten(inputs)]
        shapes = {id(x): tuple(x.shape) for x in keep}
        weights = {id(x): v for v, x in zip(variables, values, strict=True)}
        trace = Trace([], shapes, weights, set(), keep)
        trainable, frozen = values[:trainable], values[trainable:]
        with _Recorder(trace):
            outputs, _ = model.stateless_call(
                trainable, frozen, inputs, training=False
            )
        for y in keras.tree.flatten(outputs):
            trace.outputs.add(id(y))
            trace.keep.append(y)
    return trace


def keras_itemsize(dtype) -> int:
    """The bytes per element of a Keras dtype (`"bfloat16"`: 2)."""
    return getattr(torch, str(dtype)).itemsize


def nbytes(variable) -> int:
    """A variable's size in bytes."""
    return math.prod(variable.shape) * keras_itemsize(variable.dtype)


def _short(error):
    """An error's message on one line, without Keras's call summary."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception enc")]
    return (lines[0] if lines else type(error).__name__)[:200]


def _host_memory_bytes():
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def record(build, sample_input=None):
    """`(model, Trace)` of `build()` run once on `meta`, else on the CPU
    (warned); raises if the model would not fit in host memory."""
    import keras
    from keras.src.backend.common import global_state

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)  # plain, shape-only weights
    # Layer names (`dense_1`) taken here are given back for the user's build.
    names = copy.copy(global_state.get_global_attribute("object_name_uids"))
    model = None
    try:
        model = build_on(build, "meta")
        return model, _trace_call(model, sample_input, fake=True)
    except Exception as error:  # noqa: BLE001 (retried on the CPU)
        layer = None  # the innermost Keras layer in the traceback
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.layers.Layer):
                layer = owner.name
        where = f"layer {layer!r}" if layer else "the model"
        if model is not None:
            need = sum(nbytes(v) for v in model.weights)
            have = _host_memory_bytes()
            if have is not None and need > have // 2:
                raise RuntimeError(
                    f"auto_layout: {where} cannot run on the meta device "
                    f"({type(error).__name__}: {_short(error)}), and "
                    "building the model on the CPU needs "
                    f"{need / 2**30:.1f} GiB of the {have / 2**30:.1f} "
                    "GiB free: give auto_layout a smaller configuration "
                    "of the same architecture (the layouts depend on "
                    "the graph, not the sizes, except for divisibility)"
                ) from error
        warnings.warn(
            f"auto_layout: {where} cannot be built or called on the "
            f"meta device ({type(error).__name__}: {_short(error)}); "
            "building it on the CPU instead",
            stacklevel=2,
        )
        model = build_on(build, "cpu")
        return model, _trace_call(model, sample_input, fake=False)
    finally:
        keras.distribution.set_distribution(previous)
        global_state.set_global_attribute("object_name_uids", names)
