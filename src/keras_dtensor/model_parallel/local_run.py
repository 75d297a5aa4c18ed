"""The one entry of ModelParallel (`call_layer`) and the local run: a
model's outermost call on this rank's rows, as plain tensors.

Outputs leave with partial sums reduced. A model whose `LocalRunSpec`
allows it takes local rows in and gives batch-sharded DTensors out; a
layer that adds a loss or assigns a variable sends it back to DTensors.
"""

import contextlib
import contextvars
import functools
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
from keras_dtensor.backend.batch_layout import distribute_batch
from keras_dtensor.backend.shards import from_local
from keras_dtensor.model_parallel import boundary_layers
from keras_dtensor.model_parallel import fsdp_blocks
from keras_dtensor.model_parallel import local_grads
from keras_dtensor.model_parallel import local_run_check
from keras_dtensor.model_parallel import local_run_spec
from keras_dtensor.model_parallel.boundary_layers import reduce_partial
from keras_dtensor.model_parallel.fsdp_blocks import gathered_weights
from keras_dtensor.model_parallel.reference_run import recorder

__all__ = ["active", "call_layer"]

_ACTIVE = contextvars.ContextVar("keras_dtensor_local_batch", default=False)
_GROUPS = "_keras_dtensor_gather_groups"
# The grouped-gather `Session` of the running local call.
_SESSION = contextvars.ContextVar("keras_dtensor_gather_session", default=None)


def active():
    """Whether a local call is running (nested layer calls leave it be)."""
    return _ACTIVE.get()


def _input_rows(run_spec, flat):
    """`(global rows, local rows)` of the batch-sharded inputs (`()` on a
    mesh without the batch axis); None when laid out otherwise."""
    rows = None if run_spec.dim is not None else ()
    for x in flat:
        if not isinstance(x, DTensor):
            continue
        if x.device_mesh != run_spec.mesh or not run_spec.whole(x.placements):
            return None
        if run_spec.dim is not None and x.placements[run_spec.dim] == Shard(0):
            shape = (x.shape[0], x.to_local().shape[0])
            if rows not in (None, shape):
                return None
            rows = shape
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
    out = from_local(x, run_spec.mesh, placements, shape)
    mask = getattr(x, "_keras_mask", None)
    if mask is not None:
        out._keras_mask = _to_global(run_spec, rows, mask, layer)
    return out


@contextlib.contextmanager
def _local_weights(run_spec, layout, kept):
    """Every weight but the `kept` reads as its whole local tensor, the
    gathered ones by a `fsdp_blocks.Session` (yielded, else None)."""
    variables = [variable for variable, _, _ in run_spec.weights]
    values = [variable._value for variable in variables]
    whole = list(values)  # kept, and shards until their group gathers
    session = None
    if run_spec.gathered:
        if layout is None:  # all gathered for the whole call
            root = tuple(i for i in run_spec.gathered if i not in kept)
            layout = fsdp_blocks.Layout((), {}, root, ())
        group = run_spec.mesh.get_group(run_spec.dim)
        session = fsdp_blocks.Session(run_spec, layout, values, group)
        for i, full in session.gather_root().items():
            whole[i] = full
    read = [
        i
        for i, (_, gather, _) in enumerate(run_spec.weights)
        if not gather and i not in kept
    ]
    locals_ = local_grads.local_many(
        [values[i] for i in read], [run_spec.weights[i][2] for i in read]
    )
    for i, local_tensor in zip(read, locals_, strict=True):
        whole[i] = local_tensor
    try:
        for variable, value in zip(variables, whole, strict=True):
            variable._value = value
        if session is None or not layout.groups:
            yield None
            return
        with (
            torch.autograd.graph.saved_tensors_hooks(
                session.pack, session.unpack
            ),
            context.scoped(_SESSION, session),
        ):
            try:
                yield session
            finally:
                session.close()
    finally:
        for variable, value in zip(variables, values, strict=True):
            variable._value = value


def _inner_call(layer, original, args, kwargs):
    """A layer called inside a local call."""
    replay = boundary_layers.current_replay()
    try:
        if replay is not None and id(layer) in replay.record.boundary:
            return boundary_layers.boundary_call(
                replay, layer, original, args, kwargs, _dtensor_scope
            )
        if replay is not None and replay.record.fingerprints is not None:
            return boundary_layers.checked_call(
                replay, layer, original, args, kwargs
            )
        hook = _SESSION.get()
        if hook is not None:
            hook.enter(layer)
        return original(layer, *args, **kwargs)
    except Exception:
        boundary_layers.failed_in(layer)  # a local run being checked
        raise


@contextlib.contextmanager
def _dtensor_scope(layer):
    """A boundary layer's call as DTensors, as outside a local call."""
    with (
        context.scoped(_ACTIVE, False),
        context.global_values(),
        gathered_weights(layer, context.active()),
    ):
        yield


@contextlib.contextmanager
def _plain_only():
    """No implicit replication: a DTensor meeting a local tensor raises."""
    with context.scoped(_ACTIVE, True), context.global_values(allowed=False):
        yield


def _layout(layer, run_spec):
    """The model's `fsdp_blocks.Layout`, or None (all gathered at once)."""
    if not run_spec.gathered:
        return None
    cached = object_state.get_on(layer, _GROUPS)
    if cached is None or cached[0] is not run_spec:
        layout = fsdp_blocks.build(layer, run_spec, order=None)
        cached = object_state.set_on(layer, _GROUPS, (run_spec, layout))
    return None if cached[1] is None or cached[1].failed else cached[1]


def _run(layer, original, run_spec, args, kwargs, layout, replay=None):
    kept = run_spec.kept if replay is None else replay.record.kept
    with (
        _local_weights(run_spec, layout, kept) as session,
        _plain_only(),
        boundary_layers.replaying(replay),
    ):
        outputs = original(layer, *args, **kwargs)
    if layout is not None and layout.order is None:
        # The groups again, in the order this call reached the layers.
        rebuilt = fsdp_blocks.build(layer, run_spec, order=session.order)
        object_state.set_on(layer, _GROUPS, (run_spec, rebuilt))
    return outputs


def _call(layer, original, run_spec, args, kwargs, reference):
    """`(True, outputs)` of the call on local rows, or `(False, None)`:
    run as DTensors (`reference()`, which `local_run_check` compares)."""
    flat = fast_tree.flatten((args, kwargs))
    if run_spec.boundary:
        # On the spec's mesh, no partial sums, no compiled forward
        # (`jit_compile=True`): what the islands need.
        if object_state.get_on(layer, "call") is not None or any(
            isinstance(x, DTensor)
            and (
                x.device_mesh != run_spec.mesh
                or any(p.is_partial() for p in x.placements)
            )
            for x in flat
        ):
            return False, None
    else:
        rows = _input_rows(run_spec, flat)
        if rows is None:
            return False, None
    local_args, local_kwargs = fast_tree.map_structure(
        lambda x: x.to_local() if isinstance(x, DTensor) else x, (args, kwargs)
    )
    run = functools.partial(
        _run, layer, original, run_spec, local_args, local_kwargs
    )
    if run_spec.boundary:
        return local_run_check.call(
            layer, run_spec, flat, reference, lambda replay: run(None, replay)
        )
    layout = _layout(layer, run_spec)
    assigned = False
    try:
        outputs = run(layout)
    except errors.AssignedInCall:
        assigned = True  # caught before the write: nothing changed
    except RuntimeError as error:
        if layout is None or "mixed torch.Tensor and DTensor" not in str(error):
            raise
        # A freed weight read outside its unit: every rank fails here.
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
            outputs = run(None)
        except errors.AssignedInCall:
            assigned = True
    added = local_run_spec.adding_losses(run_spec.layers)
    if added or assigned:
        for sub in added:
            sub._losses.clear()
        local_run_spec.forget(layer)
        return False, None
    return True, fast_tree.map_structure(
        lambda x: _to_global(run_spec, rows, x, layer), outputs
    )


def _grad_in_layout(placements, grad):
    """A gradient hook: partial sums reduced to the forward `placements`."""
    if not isinstance(grad, DTensor) or len(grad.placements) != len(placements):
        return grad
    target = [
        forward if grad_p.is_partial() and not forward.is_partial() else grad_p
        for grad_p, forward in zip(grad.placements, placements, strict=True)
    ]
    if target == list(grad.placements):
        return grad
    return grad.redistribute(grad.device_mesh, target)


def _laid_out(x):
    """`x` with partial sums reduced, its gradient laid out as `x`."""
    x = reduce_partial(x)
    if (
        isinstance(x, DTensor)
        and x.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    ):
        x.register_hook(functools.partial(_grad_in_layout, tuple(x.placements)))
    return x


def _reduced(outputs):
    """A layer's outputs with partial sums reduced."""
    return fast_tree.map_structure(_laid_out, outputs)


def call_layer(layer, original, args, kwargs, distribution):
    """Runs `original(layer, *args, **kwargs)` (Keras's `Layer.__call__`)
    under `distribution`; returns DTensors with no partial sums, or plain
    tensors inside a local run."""
    if not torch.compiler.is_compiling() and active():
        return _inner_call(layer, original, args, kwargs)
    from keras.src.backend.common import global_state

    if global_state.get_global_attribute("current_call_ctx") is not None:
        if torch.compiler.is_compiling():
            # No context manager around a traced call: Keras's own
            # graph breaks inside it would force a recompile per layer.
            return _reduced(original(layer, *args, **kwargs))
        record = recorder()  # a run to check against
        if record is not None:
            key = record.enter(layer, args, kwargs)
        with gathered_weights(layer, distribution):
            outputs = _reduced(original(layer, *args, **kwargs))
        if record is not None:
            record.leave(key, outputs)
        return outputs
    args, kwargs = distribute_batch((args, kwargs), distribution)

    def as_dtensors():
        with context.global_values(), gathered_weights(layer, distribution):
            return _reduced(original(layer, *args, **kwargs))

    local = local_run_spec.spec_for(layer, distribution)
    if local is not None:
        done, outputs = _call(layer, original, local, args, kwargs, as_dtensors)
        if done:
            return outputs
    return as_dtensors()
