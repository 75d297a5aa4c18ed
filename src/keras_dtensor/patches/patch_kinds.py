"""The kinds of entries of the `PATCHES` table: each applies itself
(returning what it saved), restores that, and tells whether its
replacement is still in place."""

import dataclasses
import functools
import pkgutil
import types
import warnings
from collections.abc import Callable
from typing import Any

from keras_dtensor import compat

__all__ = [
    "MISSING",
    "TAG",
    "CacheKey",
    "Patch",
    "Registration",
    "applies",
    "apply_all",
    "restore_all",
    "status_of",
]

TAG = "__keras_dtensor_patch__"
MISSING = object()


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Entry:
    """The Keras and torch versions an entry applies to (keyword-only)."""

    keras: str = str(compat.SUPPORTED_KERAS)
    torch: str = str(compat.SUPPORTED_TORCH)

    def check(self):
        """Raises unless the entry's target resolves on this install."""


@dataclasses.dataclass(frozen=True)
class Patch(_Entry):
    """One replaced attribute: `module`, `attribute` (`Class.method` for
    a class attribute), `why` (what breaks without it) and `factory`
    (`original -> replacement`; `None` original when absent)."""

    module: str
    attribute: str
    why: str
    factory: Callable[[Any], Any]

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    def owner(self):
        path = self.attribute.rpartition(".")[0]
        return pkgutil.resolve_name(f"{self.module}:{path}")

    @property
    def name(self) -> str:
        return self.attribute.rsplit(".", 1)[-1]

    def check(self):
        try:
            self.owner()
        except (ImportError, AttributeError) as e:
            raise RuntimeError(
                f"keras_dtensor's hook on {self.target} has no target on "
                f"keras {compat.keras_version()}, torch "
                f"{compat.torch_version()}: {e}"
            ) from e

    def apply(self):
        owner = self.owner()
        own = self.name in owner.__dict__
        original = getattr(owner, self.name, None)
        replacement = self.factory(original)
        if isinstance(replacement, types.FunctionType):
            replacement.__wrapped__ = original
            setattr(replacement, TAG, self.target)
        setattr(owner, self.name, replacement)
        return (owner, own, original, replacement)

    def restore(self, saved):
        owner, own, original, replacement = saved
        if owner.__dict__.get(self.name, MISSING) is not replacement:
            warnings.warn(
                f"{self.target} was replaced again after keras_dtensor "
                "installed its hook; leaving the newer value in place.",
                stacklevel=4,
            )
            return
        if own:
            setattr(owner, self.name, original)
        else:
            delattr(owner, self.name)

    def is_current(self, saved):
        return self.owner().__dict__.get(self.name, MISSING) is saved[3]


def _refined(strategy_func, refine, op_schema):
    return refine(strategy_func(op_schema), op_schema)


def _propagator():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


@dataclasses.dataclass(frozen=True)
class Registration(_Entry):
    """A DTensor sharding `strategy` registered for `ops()` (resolved when
    applied); `refine(OpStrategy, OpSchema)` rewrites what it expands to."""

    name: str
    ops: Callable[[], list]
    strategy: Callable[..., Any]
    why: str
    refine: Callable[..., Any] | None = None

    @property
    def target(self) -> str:
        return f"DTensor sharding strategy: {self.name}"

    def apply(self):
        from torch.distributed.tensor.experimental import register_sharding

        propagator = _propagator()
        saved = []
        for op in self.ops():
            before = (
                propagator.op_strategy_funcs.get(op, MISSING),
                propagator.op_to_schema_info.get(op, MISSING),
                # torch's own single-dim rule would win: set aside.
                propagator.op_single_dim_strategy_funcs.pop(op, MISSING),
            )
            register_sharding(op)(self.strategy)
            if self.refine is not None:
                propagator.op_strategy_funcs[op] = functools.partial(
                    _refined, propagator.op_strategy_funcs[op], self.refine
                )
            saved.append((op, *before, propagator.op_strategy_funcs[op]))
        propagator.propagate_op_sharding.cache_clear()
        return saved

    def restore(self, saved):
        propagator = _propagator()
        for op, strategy, schema, single_dim, ours in saved:
            if propagator.op_strategy_funcs.get(op) is not ours:
                warnings.warn(
                    f"The sharding strategy of {op} was registered again "
                    "after keras_dtensor's; leaving the newer one in place.",
                    stacklevel=4,
                )
                continue
            for table, value in (
                (propagator.op_strategy_funcs, strategy),
                (propagator.op_to_schema_info, schema),
                (propagator.op_single_dim_strategy_funcs, single_dim),
            ):
                if value is MISSING:
                    table.pop(op, None)
                else:
                    table[op] = value
        propagator.propagate_op_sharding.cache_clear()

    def is_current(self, saved):
        propagator = _propagator()
        return all(
            propagator.op_strategy_funcs.get(op) is ours
            for op, *_, ours in saved
        )


@dataclasses.dataclass(frozen=True)
class CacheKey(_Entry):
    """`op()`'s arguments from `static_argnum` on hashed into its
    sharding-propagation cache key (else another call's output shape comes
    back)."""

    op: Callable[[], Any]
    static_argnum: int
    why: str

    def check(self):
        self.op()

    @property
    def target(self) -> str:
        op, argnum = self.op(), self.static_argnum
        return f"DTensor sharding cache key: {op} from argument {argnum}"

    def apply(self):
        propagator = _propagator()
        op = self.op()
        tables = (  # the schema-info table that holds `op` (2.14 has two)
            propagator.op_to_schema_info,
            getattr(
                propagator, "op_to_schema_info_for_single_dim_strategy", {}
            ),
        )
        table = next((t for t in tables if op in t), None)
        before = MISSING if table is None else table[op]
        if before is MISSING or before.static_argnum <= self.static_argnum:
            return (table, op, before, before)  # nothing to fix on this torch
        ours = dataclasses.replace(before, static_argnum=self.static_argnum)
        table[op] = ours
        propagator.propagate_op_sharding.cache_clear()
        return (table, op, before, ours)

    def restore(self, saved):
        table, op, before, ours = saved
        if ours is not before and table.get(op) is ours:
            table[op] = before
            _propagator().propagate_op_sharding.cache_clear()

    def is_current(self, saved):
        table, op, _, ours = saved
        return table is not None and table.get(op) is ours


def applies(entry):
    """`(True, "")` if `entry` applies to the installed versions, else
    `(False, why not)`."""
    for package, installed in (
        ("keras", compat.keras_version()),
        ("torch", compat.torch_version()),
    ):
        spec = getattr(entry, package)
        if not compat.contains(spec, installed):
            return False, f"applies to {package}{spec}; installed {installed}"
    return True, ""


def apply_all(entries, saved):
    """Applies the entries that apply here into `saved[target]`: every
    target resolved first, then all or nothing."""
    entries = [entry for entry in entries if applies(entry)[0]]
    for entry in entries:
        entry.check()
    try:
        for entry in entries:
            saved[entry.target] = entry.apply()
    except BaseException:
        restore_all(entries, saved)
        raise


def restore_all(entries, saved):
    """Restores, in reverse order, every entry whose original is in `saved`."""
    for entry in reversed(entries):
        original = saved.pop(entry.target, None)
        if original is not None:
            entry.restore(original)


def status_of(entries, saved):
    """`[(target, state, why)]`, as `keras_dtensor.patches.status()`."""
    result = []
    for entry in entries:
        original = saved.get(entry.target)
        ok, reason = applies(entry)
        state = "replaced by another library"
        if not ok:
            state = f"skipped: {reason}"
        elif original is None:
            state = "original"
        elif entry.is_current(original):
            state = "applied"
        result.append((entry.target, state, entry.why))
    return result
