"""Attributes keras_dtensor sets on individual Keras objects.

Besides the class and module attributes of the `PATCHES` table, hooks
keep a little state on the objects it belongs to: a model's wrapped step
function, its compiled `call`, its DataParallel state, an optimizer's
slot records, a distribution's layout caches. Every such attribute is set
through `set_on`, which remembers what it replaced; `keras_dtensor.
uninstall()` calls `restore()`, which puts back the previous value (or
removes the attribute) and runs the attribute's `undo` (e.g. removing
gradient hooks), on every object still alive.

Attributes are set with `object.__setattr__`: Keras's tracking (layers,
optimizers) must not see them.
"""

import contextlib
import weakref

__all__ = ["get_on", "restore", "set_on", "status", "swapped"]

_MISSING = object()
# On each object: {name: (previous value, our value, undo)}, the saved
# originals. Kept on the object itself, not in a registry keyed by it: the
# values (a model's step functions) refer back to the object, so a
# WeakKeyDictionary entry would keep every model that ever trained alive,
# with its weights and optimizer state, after the program dropped it.
_RECORD = "_keras_dtensor_saved"
# The objects that hold a record, for `restore()` and `status()`.
_OBJECTS = weakref.WeakSet()


def _record(obj):
    return obj.__dict__.get(_RECORD, {})


def set_on(obj, name, value, undo=None):
    """Sets `obj.<name> = value`, recorded for `restore()`.

    Args:
        obj: the Keras object (model, optimizer, distribution).
        name: the attribute.
        value: the new value.
        undo: called with `value` when `restore()` takes it off.

    Returns:
        `value`.
    """
    saved = obj.__dict__.get(_RECORD)
    if saved is None:
        saved = {}
        object.__setattr__(obj, _RECORD, saved)
        _OBJECTS.add(obj)
    previous = obj.__dict__.get(name, _MISSING)
    entry = saved.get(name)
    if entry is not None and previous is entry[1]:
        previous = entry[0]  # replacing our own value: keep what it hid
    saved[name] = (previous, value, undo)
    object.__setattr__(obj, name, value)
    return value


def get_on(obj, name, default=None):
    """`obj.<name>` if keras_dtensor set it (else `default`).

    Called on every layer call of a DataParallel step: the record is read
    inline (one dict lookup when the object has none)."""
    attributes = obj.__dict__
    saved = attributes.get(_RECORD)
    entry = None if saved is None else saved.get(name)
    if entry is None or attributes.get(name, _MISSING) is not entry[1]:
        return default
    return entry[1]


def restore():
    """Puts back every attribute `set_on` replaced that still holds ours."""
    for obj in list(_OBJECTS):
        saved = _record(obj)
        for name, (previous, value, undo) in saved.items():
            if obj.__dict__.get(name, _MISSING) is value:
                if previous is _MISSING:
                    object.__delattr__(obj, name)
                else:
                    object.__setattr__(obj, name, previous)
            if undo is not None:
                undo(value)
        if _RECORD in obj.__dict__:
            object.__delattr__(obj, _RECORD)
    _OBJECTS.clear()


def status():
    """`(type name, attribute)` of every attribute currently set."""
    return sorted(
        (type(obj).__name__, name)
        for obj in list(_OBJECTS)
        for name in _record(obj)
    )


@contextlib.contextmanager
def swapped(obj, name, value):
    """`obj.<name>` is `value` for the block (in its instance dict, out of
    Keras's tracking), then what it was: a value for one call, never left
    behind, so nothing for `restore()` to undo."""
    previous = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if previous is _MISSING:
            del obj.__dict__[name]
        else:
            obj.__dict__[name] = previous
