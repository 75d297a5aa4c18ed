"""Only this rank's shard drawn, with the values one process would draw."""

import functools
import math

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["LocalDraws", "chunked_draws_match", "supports"]

_BLOCK_ELEMENTS = 1 << 20
_DRAWS = (torch.rand, torch.normal)
_FILLS = {torch.zeros: 0, torch.ones: 1, torch.empty: None}


def _grid(rows, row_elements, block_elements):
    """The `(start, stop)` row blocks of a draw, of 16n elements each."""
    step = 16 // math.gcd(row_elements, 16)
    block = max(1, block_elements // max(row_elements, 1))
    block = max(step, block - block % step)
    edges = [*range(0, rows, block), rows]
    bounds = list(zip(edges[:-1], edges[1:], strict=True))
    if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * row_elements < 16:
        bounds[-2:] = [(bounds[-2][0], rows)]
    return bounds


class LocalDraws(TorchFunctionMode):
    """Creation ops of the global `shape` answered with this rank's part."""

    def __init__(self, shape, ranges, block_elements=None):
        super().__init__()
        self.shape = tuple(shape)
        self.ranges = ranges
        self.block_elements = block_elements or _BLOCK_ELEMENTS
        self.inner = tuple(slice(s, s + n) for s, n in ranges[1:])
        self.grid = None  # the stream's blocks, from its first draw
        self.next = 0  # the next block to draw
        self.generator = None
        self.answered = 0
        self._last_draw = None

    def _read(self, draw, window, inner):
        """Draws blocks up to the end of `window`; its rows cut by `inner`."""
        lo, hi = window
        out = None
        while self.next < len(self.grid) and self.grid[self.next][0] < hi:
            start, stop = self.grid[self.next]
            values = draw(stop - start)
            self.next += 1
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                part = values[(slice(a - start, b - start), *inner)]
                if out is None:
                    out = part.new_empty((hi - lo, *part.shape[1:]))
                out[a - lo : b - lo] = part
            del values
        return out

    def _matches(self, size):
        if size is None or not self.shape:
            return False
        return tuple(size)[: len(self.shape)] == self.shape

    def _local_shape(self, size):
        rows = self.window[1] - self.window[0]
        inner = [n for _, n in self.ranges[1:]]
        return [rows, *inner, *tuple(size)[len(self.shape) :]]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DRAWS and self._matches(kwargs.get("size")):
            size = tuple(kwargs.pop("size"))
            if self.grid is None:
                rest = math.prod(size[1:])
                self.grid = _grid(size[0], rest, self.block_elements)
                self.generator = kwargs.get("generator")
            kwargs["generator"] = self.generator

            def draw(rows):
                return func(*args, size=(rows, *size[1:]), **kwargs)

            self._last_draw = draw
            self.answered += 1
            out = self._read(draw, self.window, self.inner)
            if out is None:  # this rank holds no rows
                out = torch.empty(
                    self._local_shape(size),
                    dtype=kwargs.get("dtype"),
                    device=kwargs.get("device"),
                )
            return out
        if func in _FILLS:
            size = kwargs.pop("size", None)
            if size is None and args:
                size, args = args[0], args[1:]
            if self._matches(size):
                self.answered += 1
                return func(self._local_shape(size), *args, **kwargs)
            if size is not None:
                kwargs["size"] = size
        return func(*args, **kwargs)

    def run(self, initializer, dtype, blockwise):
        """This rank's shard of `initializer(shape, dtype)`, or `None`."""
        row_start, row_count = self.ranges[0]
        stop = row_start + row_count
        windows = [(row_start, stop)]
        if blockwise:
            rest = math.prod(self.shape[1:])
            grid = _grid(self.shape[0], rest, self.block_elements)
            cut = [(max(a, row_start), min(b, stop)) for a, b in grid]
            windows = [(a, b) for a, b in cut if a < b] or windows
        local = None
        for lo, hi in windows:
            self.window = (lo, hi)
            with self:
                value = initializer(self.shape, dtype=dtype)
            if not self.answered:
                return None
            if len(windows) == 1:
                local = value
                break
            if local is None:
                local = value.new_empty((row_count, *value.shape[1:]))
            local[lo - row_start : hi - row_start] = value
            del value
        if self.grid is not None and self.generator is None:
            # The global generator: left where one whole draw leaves it.
            end = (self.shape[0], self.shape[0])
            self._read(self._last_draw, end, ())
        return local


@functools.cache
def chunked_draws_match(device):
    """Whether block-wise draws reproduce one whole draw on `device`."""
    shape, ranges = (257, 5), [(100, 57), (1, 3)]
    for func, extra in ((torch.rand, ()), (torch.normal, (0.0, 2.0))):
        for dtype in (torch.float32, torch.float64):

            def initializer(shape, dtype, func=func, extra=extra):
                g = torch.Generator(device=device).manual_seed(7)
                return func(
                    *extra, size=shape, generator=g, dtype=dtype, device=device
                )

            whole = initializer(shape, dtype)[100:157, 1:4]
            for blockwise in (False, True):
                draws = LocalDraws(shape, ranges, block_elements=64)
                local = draws.run(initializer, dtype, blockwise)
                if local is None or not torch.equal(local, whole):
                    return False
    return True


def supports(initializer):
    """Whether `initializer` is one of Keras's elementwise initializers."""
    from keras import initializers

    known = (
        initializers.RandomUniform,
        initializers.RandomNormal,
        initializers.TruncatedNormal,
        initializers.Zeros,
        initializers.Ones,
        initializers.Constant,
        initializers.VarianceScaling,
    )
    for base in known:
        if isinstance(initializer, base):
            return type(initializer).__call__ is base.__call__
    return False
