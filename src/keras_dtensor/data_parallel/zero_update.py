"""The optimizer update split by whole variable (ZeRO stage 1) inside `fit`.

The slots a rank does not own go stale until `sync_optimizer_state`.
Design: `docs/internals/data-parallel.md`.
"""

import contextlib
import contextvars
import functools
import weakref

from keras_dtensor import config
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend.launch import world
from keras_dtensor.data_parallel.state import state_of
from keras_dtensor.ops.flat_buffers import FlatParams
from keras_dtensor.ops.flat_buffers import broadcast_packed
from keras_dtensor.ops.flat_buffers import nbytes

__all__ = [
    "UpdateSplit",
    "broadcast_from_rank0",
    "splitting_updates",
    "has_stale_state",
    "sync_optimizer_state",
    "wrap_add_variable_from_reference",
    "wrap_backend_update_step",
]

_SLOTS = "_keras_dtensor_slots"
_ACTIVE = contextvars.ContextVar("keras_dtensor_update_split", default=None)


def broadcast_from_rank0(variables):
    """Rank 0's values everywhere (as DDP does at construction)."""
    values = [v.value for v in variables]
    broadcast_packed(values, [0] * len(values))


class UpdateSplit:
    """Which rank updates which of `variables`: whole variables, largest
    first to the least-loaded rank (none for a model under
    `$KERAS_DTENSOR_SPLIT_UPDATE_MB`); `owners`: each one's, or `None`."""

    def __init__(self, variables):
        self.world, self.rank = world()
        self.owner = {}
        self.owners = self.buffers = None
        self.checked = weakref.WeakKeyDictionary()  # optimizer -> bool
        # optimizer -> {id(model variable): owner} of stale slots
        self.stale = weakref.WeakKeyDictionary()
        self.depth = 0
        self.partial = False  # gradients went to their owners only
        # Gradient overwrite (float8 scales) needs every global gradient.
        self.overwritten = any(v.overwrite_with_gradient for v in variables)
        values = [v.value for v in variables]
        if len(variables) < self.world or (
            sum(map(nbytes, values)) < config.get("SPLIT_UPDATE_MB") * 2**20
        ):
            return
        load = [0] * self.world
        for i in sorted(range(len(values)), key=lambda i: -values[i].numel()):
            rank = load.index(min(load))
            self.owner[id(variables[i])] = rank
            load[rank] += values[i].numel()
        self.owners = [self.owner[id(v)] for v in variables]
        if config.get("SPLIT_UPDATE"):
            self.buffers = FlatParams(values, self.owners)

    def release(self):
        """Gives the parameters storage of their own again."""
        if self.buffers is not None:
            self.buffers.release()
            self.buffers = None

    def splits(self, optimizer):
        """Whether `optimizer`'s update can be split (cached)."""
        if not self.owner:
            return False
        known = self.checked.get(optimizer)
        if known is None:
            known = self.checked[optimizer] = _splittable(optimizer)
        return known

    def to_owners(self, optimizer):
        """Whether gradients may go to their owners only."""
        if self.checked.get(optimizer) is not True:
            return False
        if optimizer.global_clipnorm or optimizer.gradient_accumulation_steps:
            return False
        from keras.src.optimizers.base_optimizer import BaseOptimizer as base

        for name in _WHOLE_GRADIENT_METHODS:
            if getattr(type(optimizer), name, None) is not getattr(base, name):
                return False
        return not self.overwritten


# Optimizer methods that see every gradient before the per-variable update.
_WHOLE_GRADIENT_METHODS = (
    "apply",
    "_backend_apply_gradients",
    "_clip_gradients",
    "_filter_empty_gradients",
    "_overwrite_variables_directly_with_gradients",
)


def _slots(optimizer):
    """`[(slot, the model variable it was made for)]` of `optimizer`."""
    return object_state.get_on(optimizer, _SLOTS, [])


def _splittable(optimizer):
    """Keras's own per-variable update, every non-scalar variable a slot."""
    if not config.get("SPLIT_UPDATE"):
        return False
    # A custom parallel step may couple variables.
    step = getattr(type(optimizer), "_parallel_update_step", None)
    if step is not None and not getattr(step, "__module__", "").startswith(
        "keras."
    ):
        return False
    slots = {id(slot) for slot, _ in _slots(optimizer)}
    return all(id(v) in slots or len(v.shape) == 0 for v in optimizer.variables)


def wrap_backend_update_step(original):
    """Wraps `_backend_update_step`: each rank updates its variables, then
    broadcasts them (clipping ran before, EMA and constraints run after)."""

    @functools.wraps(original)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if context.current() is None:  # traced by torch.compile: no break
            return original(self, grads, trainable_variables, learning_rate)
        split = _ACTIVE.get()
        if split is None or split.depth or not split.splits(self):
            return original(self, grads, trainable_variables, learning_rate)
        grads, variables = list(grads), list(trainable_variables)
        owners = [split.owner.get(id(v)) for v in variables]
        if None in owners or len(set(owners)) < split.world:
            # Variables from outside the model, or a rank with nothing to
            # update (its scalars would fall behind): whole update.
            if split.partial:
                _raise_partial(self, variables, owners, split)
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
        find = split.buffers.flat_of if split.buffers else None
        broadcast_packed([v.value for v in variables], owners, find)
        stale = split.stale.setdefault(self, {})
        stale.update(zip(map(id, variables), owners, strict=True))

    return _backend_update_step


def _raise_partial(optimizer, variables, owners, split):
    unknown = [
        v.path for v, o in zip(variables, owners, strict=True) if o is None
    ]
    raise RuntimeError(
        f"keras_dtensor DataParallel (rank {split.rank} of {split.world}): "
        "this step's gradients were reduced to their owners only, but "
        f"optimizer {optimizer.name!r} cannot split its update: variables "
        f"it updates that the model's train function was not made for: "
        f"{unknown}; ranks owning one of them: "
        f"{sorted(set(owners) - {None})}. Call `compile()` again after "
        "changing which variables are trainable; with "
        "$KERAS_DTENSOR_SPLIT_UPDATE=0 every gradient is all-reduced."
    )


@contextlib.contextmanager
def splitting_updates(split, partial):
    """Optimizer updates inside split by `split` (`None`: whole)."""
    if split is not None:
        split.partial = partial
    try:
        with context.scoped(_ACTIVE, split):
            yield
    finally:
        if split is not None:
            split.partial = False


def wrap_add_variable_from_reference(original):
    """Wraps `add_variable_from_reference`: notes each slot's variable."""

    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        slot = original(self, reference_variable, *args, **kwargs)
        slots = object_state.get_on(self, _SLOTS)
        if slots is None:
            slots = object_state.set_on(self, _SLOTS, [])
        slots.append((slot, reference_variable))
        return slot

    return add_variable_from_reference


def has_stale_state(model):
    """Whether some of `model`'s optimizer slots are stale."""
    split = getattr(state_of(model, create=False), "split", None)
    return split is not None and any(split.stale.values())


def sync_optimizer_state(model):
    """Brings `model`'s stale optimizer slots back from their owners.

    A collective when anything is stale: every rank must call it at the
    same point (the end of `fit`, every save, a new train function).

    Args:
        model: the Keras model whose DataParallel `fit` split its updates.

    Example:
    >>> keras_dtensor.data_parallel.sync_optimizer_state(model)
    """
    split = getattr(state_of(model, create=False), "split", None)
    if split is None:
        return
    if world()[0] == 1:  # no group (any more): nothing to bring back
        split.stale.clear()
        return
    for optimizer, stale in list(split.stale.items()):
        pairs = [
            (slot, stale[id(ref)])
            for slot, ref in _slots(optimizer)
            if slot is not None and id(ref) in stale
        ]
        if pairs:
            broadcast_packed(
                [slot.value for slot, _ in pairs],
                [owner for _, owner in pairs],
            )
        stale.clear()
