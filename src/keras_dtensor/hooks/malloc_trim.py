"""Memory glibc keeps after `free`, given back before `fit` (if glibc)."""

import ctypes
import functools

__all__ = ["available", "release_free_memory"]


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def available():
    """Whether this process's allocator is glibc's (`malloc_trim` found)."""
    return _malloc_trim() is not None


def release_free_memory():
    """`malloc_trim(0)`: whether glibc gave some memory back to the OS."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
