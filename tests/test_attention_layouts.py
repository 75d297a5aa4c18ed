"""`keras.ops.dot_product_attention` on DTensor inputs gives the global
result, whatever the inputs' placements.

Keras 3.16's torch backend runs DTensor attention on each process's local
shards; that holds only where every input is split the same way over
batch or heads, with a mask that follows. Each case here lays the same
global query, key, value and mask out one way, on 2 processes, and
compares the output's global value with plain attention on one process:
a dropped `Partial` sum, a split sequence or a mask that does not follow
the query's split gives another number.
"""

import numpy as np
from harness import run_ranks

B, T, N, H = 4, 6, 4, 8  # batch, sequence, heads, head dim
TOLERANCE = 1e-5


def _cases():
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    q_batch, q_heads, q_seq = [Shard(0)], [Shard(2)], [Shard(1)]
    whole = [Replicate()]
    # name: (q/k/v placements, mask placements or "plain", mask shape)
    return {
        "heads": (q_heads, None, None),
        "heads, causal mask broadcast over heads": (
            q_heads,
            whole,
            (B, 1, T, T),
        ),
        "heads, plain mask broadcast over heads": (
            q_heads,
            "plain",
            (B, 1, T, T),
        ),
        "heads, mask split by heads": (q_heads, [Shard(1)], (B, N, T, T)),
        "heads, whole mask per head": (q_heads, whole, (B, N, T, T)),
        "batch": (q_batch, None, None),
        "batch, mask split by batch": (q_batch, [Shard(0)], (B, 1, T, T)),
        "batch, plain whole mask": (q_batch, "plain", (B, 1, T, T)),
        "batch, mask broadcast over batch": (q_batch, whole, (1, 1, T, T)),
        "sequence": (q_seq, None, None),
        "partial sum": ([Partial()], None, None),
    }


def _attention_cases():
    import keras
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial

    import keras_dtensor  # noqa: F401

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["model"], devices)
    distribution = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh)
    )
    torch_mesh = distribution.device_mesh.backend_mesh
    rng = np.random.default_rng(0)
    q, k, v = (
        torch.tensor(rng.normal(size=(B, T, N, H)).astype("float32"))
        for _ in range(3)
    )
    out = {}
    for name, (placements, mask_placements, mask_shape) in _cases().items():
        mask = None
        if mask_shape is not None:
            mask = torch.tensor(rng.uniform(size=mask_shape) > 0.3)
            mask[..., 0] = True  # no row masked whole
        expected = keras.ops.dot_product_attention(q, k, v, mask=mask)

        def laid_out(t, placements):
            if placements == [Partial()]:  # each rank holds half the sum
                return DTensor.from_local(t / 2, torch_mesh, placements)
            return torch.distributed.tensor.distribute_tensor(
                t, torch_mesh, placements
            )

        inputs = [laid_out(t, placements) for t in (q, k, v)]
        if mask is not None and mask_placements != "plain":
            mask = laid_out(mask, mask_placements)
        try:
            with distribution.scope():
                got = keras.ops.dot_product_attention(*inputs, mask=mask)
        except Exception as e:  # every case's outcome, not the first
            out[name] = f"{type(e).__name__}: {e}"
            continue
        if isinstance(got, DTensor):
            got = got.full_tensor()
        out[name] = float((got - expected).abs().max())
    return out


def test_sharded_attention_equals_one_process():
    for out in run_ranks(_attention_cases, 2):
        bad = {
            name: d
            for name, d in out.items()
            if isinstance(d, str) or not d <= TOLERANCE
        }
        assert not bad, bad
        assert set(out) == set(_cases())
