"""An einsum's layout from its subscripts: pure, cached per signature."""

import functools
import math

from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

__all__ = ["matmul_subscripts", "plan_for"]


def matmul_subscripts(ndim):
    """The einsum of `matmul(x, kernel)` for an `ndim`-dim `x` (to 8)."""
    if not 1 <= ndim <= 8:
        return None
    rows = "abcdefgh"[: ndim - 1]
    return f"{rows}y,yz->{rows}z"


@functools.lru_cache(maxsize=1024)
def plan_for(subscripts, mesh, specs):
    """`(targets, grads, output placements, shape)` of operands `specs`
    (`(placements, global shape)` each); `None` where torch decides."""
    shapes = [shape for _, shape in specs]
    text = subscripts.replace(" ", "")
    if "..." in text or "->" not in text:
        return None
    inputs, output = text.split("->")
    inputs = inputs.split(",")
    if len(inputs) != len(shapes):
        return None
    sizes = {}
    for sub, shape in zip(inputs, shapes, strict=True):
        if len(sub) != len(shape) or len(set(sub)) != len(sub):
            return None
        for letter, n in zip(sub, shape, strict=True):
            if sizes.setdefault(letter, n) != n:
                return None  # broadcast over a letter
    targets = [list(placements) for placements, _ in specs]
    grads = [list(placements) for placements, _ in specs]
    placements = []
    for m in range(mesh.ndim):
        letters = {}  # sharded letter -> elements of the operands it cuts
        for sub, (operand_placements, shape) in zip(inputs, specs, strict=True):
            p = operand_placements[m]
            if p.is_replicate():
                continue
            if type(p) is not Shard:
                return None
            letters[sub[p.dim]] = letters.get(sub[p.dim], 0) + math.prod(shape)
        if not letters:
            placements.append(Replicate())
            continue
        # Two letters on one mesh dim: keep one no rank is empty of, then
        # the one cutting the most elements; gather operands cut otherwise.
        letter = min(
            letters,
            key=lambda k: (sizes[k] < mesh.size(m), -letters[k], k),
        )
        for i, sub in enumerate(inputs):
            if letter in sub:
                targets[i][m] = grads[i][m] = Shard(sub.index(letter))
            else:
                targets[i][m] = Replicate()
                # Its gradient sums over the letter's shards.
                grads[i][m] = Partial()
        placements.append(
            Shard(output.index(letter)) if letter in output else Partial()
        )
    # One dim over several mesh dims: left to torch.
    for target in targets:
        dims = [p.dim for p in target if isinstance(p, Shard)]
        if len(dims) != len(set(dims)):
            return None
    shape = tuple(sizes[letter] for letter in output)
    return (
        tuple(map(tuple, targets)),
        tuple(map(tuple, grads)),
        tuple(placements),
        shape,
    )
