"""Attributes keras_dtensor sets on Keras objects, out of Keras's tracking,
recorded so that `restore()` (from `uninstall()`) puts back what they hid.
"""

import contextlib
import weakref

__all__ = ["get_on", "restore", "set_on", "status", "swapped"]

_MISSING = object()
# On each object: {name: (previous, ours, undo)}; not a WeakKeyDictionary,
# whose values (step functions refer to the model) keep models alive.
_RECORD = "_keras_dtensor_saved"
# The objects that hold a record, for `restore()` and `status()`.
_OBJECTS = weakref.WeakSet()


def _record(obj):
    return obj.__dict__.get(_RECORD, {})


def set_on(obj, name, value, undo=None):
    """Sets and returns `obj.<name> = value`; `restore()` calls `undo`."""
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
    """`obj.<name>` if keras_dtensor set it (else `default`)."""
    entry = _record(obj).get(name)
    if entry is None or obj.__dict__.get(name, _MISSING) is not entry[1]:
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
    """`obj.<name>` is `value` for the block, then what it was."""
    previous = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if previous is _MISSING:
            del obj.__dict__[name]
        else:
            obj.__dict__[name] = previous
