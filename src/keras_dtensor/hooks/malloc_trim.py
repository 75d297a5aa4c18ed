"""Memory the C allocator keeps after `free`, given back before `fit`.

glibc keeps freed blocks below its mmap threshold (which rises to 32 MiB
as large blocks are freed) in its arenas, resident. Building a sharded
model frees many such blocks (sharded initialization draws its values in
blocks of about 1M elements; Keras builds and drops temporaries), so a
process entered `fit` holding memory it no longer used (the transformer
block of `benchmarks/bench_memory.py` has a lower fit peak with one
`malloc_trim(0)` before it). That call is cheap; it runs once per `fit`
under a distribution on several processes, and nowhere else. Other
allocators (or no glibc) make it a no-op.
"""

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
    """Gives the memory glibc holds free back to the OS (`malloc_trim(0)`).

    Returns:
        True if glibc released some memory, False otherwise (nothing to
        release, or not glibc).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
