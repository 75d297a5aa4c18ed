"""Models with whole weights run on this rank's rows, as plain tensors.

Under a layout whose weights are either replicated or sharded only over
the batch axis (FSDP-style: `("batch", None)`), every op of the model is
the same computation on each rank's rows of the batch. Left as DTensors,
each op still pays DTensor's dispatch (on a CPU, more than the op itself
in small layers) and DTensor's own choice of
redistribution. torch's FSDP2 and DDP run the module on local tensors; the
same here, at the outermost layer call (the model in `fit`, `predict`,
`model(x)`):

- the batch-sharded weights are gathered block by block (one all-gather
  per group of layers, freed after the group's forward and gathered again
  for its backward: `fsdp_blocks`, FSDP2's blocks) and every weight
  reads as its local, whole tensor while its layer runs;
- the inputs enter as this rank's rows, the outputs leave as the batch-
  sharded DTensors the loss and metrics expect;
- backward: a weight's local gradient is a partial sum over the batch axis
  (`local_grads`, as `to_local(grad_placements=Partial)` would lay
  it out): the gather's backward reduce-scatters it to the shard, the
  replicated weights' sums are reduced in buckets (`partial_grads`).

What makes a model take this path, checked once per model (and again after
any variable is created): every weight a DTensor on one mesh, replicated but
for a shard over the batch axis (a mesh axis of one process counts as
replicated: tensor-parallel layouts over a "model" axis of 1 run here too);
no BatchNormalization (its statistics span the global batch) and no layer
drawing seeded random numbers (a dropout mask is drawn for the global
batch); inputs sharded over the batch axis only. A layer that adds a loss
during its call (an activity regularizer, an MoE's auxiliary loss) is
detected after the first call: the call runs again as DTensors and the model
stays on that path, since such a loss must be a global value; so does a
layer that assigns a variable in its call (a running statistic, a stateful
RNN's state): the assignment is stopped before it writes
(`variables.wrap_direct_assign`). Like DDP, a layer is assumed to treat the
rows of a batch independently (BatchNormalization aside). Turned off with
`KERAS_DTENSOR_LOCAL_BATCH=0`.

A weight sharded over another axis (tensor-parallel) leaves its layer to
run as DTensors, an island in the local call (`boundary_layers`); such a
model's local call is checked against its DTensor call once per input
signature (`local_run_check`). Turned off with `KERAS_DTENSOR_LOCAL_MODEL=0`.
"""

import contextlib
import contextvars
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_dtensor.backend import console
from keras_dtensor.backend import context
from keras_dtensor.backend import errors
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import object_state
from keras_dtensor.backend.layout import contiguous_strides
from keras_dtensor.model_parallel import boundary_layers
from keras_dtensor.model_parallel import fsdp_blocks
from keras_dtensor.model_parallel import fsdp_weights
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import local_run_check
from keras_dtensor.model_parallel import packed_gather
from keras_dtensor.model_parallel.local_run_spec import forget
from keras_dtensor.model_parallel.local_run_spec import shards_enter
from keras_dtensor.model_parallel.local_run_spec import spec_for
from keras_dtensor.model_parallel.local_run_spec import variables_changed
from keras_dtensor.model_parallel.local_run_spec import whole_along

__all__ = [
    "AssignedInCall",
    "active",
    "call",
    "inner_call",
    "spec_for",
    "variables_changed",
]

_ACTIVE = contextvars.ContextVar("keras_dtensor_local_batch", default=False)
_GROUPS = "_keras_dtensor_gather_groups"
# The grouped-gather `Session` of the running local call.
_SESSION = contextvars.ContextVar("keras_dtensor_gather_session", default=None)


AssignedInCall = errors.AssignedInCall


def active():
    """Whether a local call is running (nested layer calls leave it be)."""
    return _ACTIVE.get()


def _input_rows(run_spec, flat):
    """`(global rows, local rows)` of the batch-sharded inputs; None when
    an input is laid out otherwise. `()` on a mesh without the batch axis
    when every input is replicated."""
    rows = None if run_spec.dim is not None else ()
    for x in flat:
        if not isinstance(x, DTensor):
            continue
        if x.device_mesh != run_spec.mesh:
            return None
        for i, placement in enumerate(x.placements):
            if i == run_spec.dim and placement == Shard(0):
                shape = (x.shape[0], x.to_local().shape[0])
                if rows not in (None, shape):
                    return None
                rows = shape
            elif not whole_along(run_spec.mesh, i, placement):
                return None
    return rows


def _to_global(run_spec, rows, x, layer):
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    placements = [Replicate()] * run_spec.mesh.ndim
    if run_spec.dim is None:  # no batch axis: the whole batch on every rank
        shape = tuple(x.shape)
    elif x.ndim == 0 or x.shape[0] != rows[1]:
        raise errors.local_output_error(
            layer=layer.name,
            shape=x.shape,
            rows=rows[1],
            rank=torch.distributed.get_rank(),
            mesh=run_spec.mesh,
        )
    else:
        placements[run_spec.dim] = Shard(0)
        shape = (rows[0], *x.shape[1:])
    out = DTensor.from_local(
        x,
        run_spec.mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )
    mask = getattr(x, "_keras_mask", None)
    if mask is not None:
        out._keras_mask = _to_global(run_spec, rows, mask, layer)
    return out


@contextlib.contextmanager
def _local_weights(run_spec, layout, kept):
    """Every weight reads as its whole local tensor. The batch-sharded
    ones are gathered together (one all-gather per dtype), or group by
    group under a `fsdp_blocks.Layout` (yields its `Session`, else
    None); backward reduce-scatters their gradients to the shards, and
    the replicated weights' gradients leave as partial sums over the
    batch axis."""
    whole = {}
    by_dtype = {}
    values = [variable._value for variable, _, _ in run_spec.weights]
    session = None
    if run_spec.gathered:
        group = run_spec.mesh.get_group(run_spec.dim)
    if layout is not None:
        session = fsdp_blocks.Session(run_spec, layout, values, group)
        for i, full in session.gather_root().items():
            whole[id(run_spec.weights[i][0])] = full
    grouped = () if layout is None else layout.grouped
    read = []  # (variable, value, gradient placements): read locally
    for i, (variable, gather, grad) in enumerate(run_spec.weights):
        value = values[i]
        if i in kept:  # a tensor-parallel layer's: stays a DTensor
            whole[id(variable)] = value
        elif not gather:
            read.append((variable, value, grad))
        elif layout is None:
            by_dtype.setdefault(value.dtype, []).append((variable, value))
            read.append((variable, value, None))
        elif i in grouped:
            whole[id(variable)] = value  # a shard until its group gathers
        # else: in `layout.root`, gathered above
    # Every weight read through one autograd edge (`local_many`).
    locals_ = local_grads.local_many(
        [value for _, value, _ in read], [grad for _, _, grad in read]
    )
    for (variable, _, _), local_tensor in zip(read, locals_, strict=True):
        whole[id(variable)] = local_tensor  # a shard, where gathered below
    for items in by_dtype.values():
        shards = [whole[id(variable)] for variable, _ in items]
        specs = [
            (value.placements[run_spec.dim].dim, tuple(value.shape))
            for _, value in items
        ]
        fulls = packed_gather.gather_shards(shards, specs, group)
        for (variable, _), full in zip(items, fulls, strict=True):
            whole[id(variable)] = full
    try:
        for variable, _, _ in run_spec.weights:
            variable._value = whole[id(variable)]
        if session is None:
            yield None
        else:
            with torch.autograd.graph.saved_tensors_hooks(
                session.pack, session.unpack
            ):
                token = _SESSION.set(session)
                try:
                    yield session
                finally:
                    _SESSION.reset(token)
                    session.close()
    finally:
        for (variable, _, _), value in zip(
            run_spec.weights, values, strict=True
        ):
            variable._value = value


def inner_call(layer, original, args, kwargs):
    """A layer called inside a local call: its weights' group gathered,
    or, for a tensor-parallel layer, run as DTensors."""
    replay = boundary_layers.current_replay()
    if replay is not None:
        try:
            if id(layer) in replay.record.boundary:
                return boundary_layers.boundary_call(
                    replay, layer, original, args, kwargs, _dtensor_scope
                )
            if replay.record.fingerprints is not None:
                return boundary_layers.checked_call(
                    replay, layer, original, args, kwargs
                )
        except Exception:
            boundary_layers.failed_in(layer)
            raise
    hook = _SESSION.get()
    if hook is not None:
        hook.enter(layer)
    try:
        return original(layer, *args, **kwargs)
    except Exception:
        boundary_layers.failed_in(layer)  # a local run being checked
        raise


@contextlib.contextmanager
def _dtensor_scope(layer):
    """A boundary layer's call inside a local call: as DTensors, as
    outside a local call (nested layers included), its weights sharded
    over the batch axis too gathered for the call."""
    token = _ACTIVE.set(False)
    try:
        with (
            context.global_values(),
            fsdp_weights.gathered_weights(layer, context.active()),
        ):
            yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def _plain_only():
    """No implicit replication inside: a DTensor meeting a local tensor
    here would be a bug, and must raise rather than mix silently."""
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = False
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        dispatcher._allow_implicit_replication = before


def _added_losses(run_spec):
    return [
        sub
        for sub in run_spec.layers
        if sub._losses
        and any(
            isinstance(loss, torch.Tensor) and not isinstance(loss, DTensor)
            for loss in sub._losses
        )
    ]


def _layout(layer, run_spec):
    """The model's `fsdp_blocks.Layout` for this call, or None (all
    weights gathered at once). Before the first call it is built from the
    layers' order; after it, again from the order the call reached them."""
    if not run_spec.gathered:
        return None
    cached = object_state.get_on(layer, _GROUPS)
    if cached is None or cached[0] is not run_spec:
        layout = fsdp_blocks.build(layer, run_spec, order=None)
        cached = object_state.set_on(layer, _GROUPS, (run_spec, layout))
    layout = cached[1]
    return None if layout is None or layout.failed else layout


def _run(layer, original, run_spec, layout, args, kwargs, replay=None):
    replaying, kept = contextlib.nullcontext(), run_spec.kept
    if replay is not None:
        replaying = boundary_layers.replaying(replay)
        kept = replay.record.kept()
    with (
        _local_weights(run_spec, layout, kept) as session,
        _plain_only(),
        replaying,
    ):
        outputs = original(layer, *args, **kwargs)
    if layout is not None and layout.order is None:
        # The groups again, in the order this call reached the layers.
        rebuilt = fsdp_blocks.build(layer, run_spec, order=session.order)
        object_state.set_on(layer, _GROUPS, (run_spec, rebuilt))
    return outputs


def _mixed(error):
    return "mixed torch.Tensor and DTensor" in str(error)


def _to_local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def call(layer, original, run_spec, args, kwargs, reference):
    """Runs `original(layer, *args, **kwargs)` on local rows.

    Returns `(True, outputs)`, or `(False, None)` when the call must run as
    DTensors instead (inputs laid out otherwise, or a loss added inside).
    `reference()` runs the call as DTensors (a tensor-parallel layout's
    first call of a signature runs both and compares).
    """
    flat = fast_tree.flatten((args, kwargs))
    if run_spec.boundary:
        if not shards_enter(run_spec, flat):
            return False, None
        return _call_tensor_parallel(
            layer, original, run_spec, args, kwargs, flat, reference
        )
    rows = _input_rows(run_spec, flat)
    if rows is None:
        return False, None
    local_args, local_kwargs = fast_tree.map_structure(
        _to_local, (args, kwargs)
    )
    layout = _layout(layer, run_spec)
    assigned = False
    try:
        outputs = _run(
            layer, original, run_spec, layout, local_args, local_kwargs
        )
    except AssignedInCall:
        assigned = True  # caught before the write: nothing changed
    except RuntimeError as error:
        if layout is None or not _mixed(error):
            raise
        # A freed weight read outside its unit's call: every rank got
        # here at the same op; from now on all weights are gathered.
        layout.failed = True
        if not console.silent():  # rank 0's, as the package's logs
            warnings.warn(
                f"keras-dtensor: {layer.name!r} reads a weight outside the "
                "layer that owns it; its batch-sharded weights are gathered "
                "for the whole call from now on (no freeing after each "
                f"layer's forward). Mesh {run_spec.mesh}.",
                stacklevel=2,
            )
        try:
            outputs = _run(
                layer, original, run_spec, None, local_args, local_kwargs
            )
        except AssignedInCall:
            assigned = True
    added = _added_losses(run_spec)
    if added or assigned:
        for sub in added:
            sub._losses.clear()
        forget(layer)
        return False, None
    return True, fast_tree.map_structure(
        lambda x: _to_global(run_spec, rows, x, layer), outputs
    )


def _call_tensor_parallel(
    layer, original, run_spec, args, kwargs, flat, reference
):
    """A tensor-parallel layout's local call (`local_run_check.call`); a
    model with a compiled forward (`jit_compile=True`) runs it over
    DTensors instead: a traced call cannot hold the DTensor islands."""
    if object_state.get_on(layer, "call") is not None:
        return False, None

    local_args, local_kwargs = fast_tree.map_structure(
        _to_local, (args, kwargs)
    )

    def run(replay):
        return _run(
            layer, original, run_spec, None, local_args, local_kwargs, replay
        )

    return local_run_check.call(layer, run_spec, flat, reference, run)
