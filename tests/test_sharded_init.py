"""Sharded initialization: each rank draws only its shard, same values.

Every case creates a variable under a distribution and compares its full
value, bit for bit, with the same variable created by plain single-process
Keras from the same seed. Blocks are made tiny so that shards start and end
inside blocks and the initializer runs once per block.
"""

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

# (initializer name, constructor kwargs); seed 3 unless a SeedGenerator.
INITIALIZERS = [
    ("RandomUniform", dict(minval=-0.5, maxval=2.0)),
    ("RandomNormal", dict(stddev=0.3)),
    ("TruncatedNormal", dict(stddev=0.3)),
    ("GlorotUniform", {}),
    ("GlorotNormal", {}),  # truncated normal inside
    ("HeNormal", {}),
    ("LecunUniform", {}),
    ("VarianceScaling", dict(distribution="untruncated_normal")),
    ("Zeros", None),
    ("Ones", None),
    ("Constant", dict(value=0.25)),
    ("Orthogonal", {}),  # not elementwise: full draw, then sliced
    ("RandomNormal", "seed_generator"),
]
# (global shape, axes over a (1, world) ["batch", "model"] mesh)
SHAPES = [
    ((37, 6), ("model", None)),  # rows: uneven, not a multiple of 16
    ((6, 37), (None, "model")),  # columns: strided in the stream
    ((9, 5, 7), (None, "model", None)),
    ((3, 4), ("model", None)),  # a shard inside one block
    ((1, 8), ("model", None)),  # an empty shard on rank 1
]


def _make(keras, name, kwargs):
    cls = getattr(keras.initializers, name)
    if name in ("Zeros", "Ones", "Constant"):
        return cls(**(kwargs or {}))
    if kwargs == "seed_generator":
        return cls(seed=keras.random.SeedGenerator(5))
    return cls(seed=3, **kwargs)


def _create(keras, shape, name, kwargs):
    keras.utils.set_random_seed(1)
    v = keras.Variable(_make(keras, name, kwargs), shape=shape, name="w")
    return v


def _chunk_shape(shape, dim, world):
    """DTensor's local shape: torch.chunk's, empty past the last chunk."""
    import torch

    parts = torch.zeros(shape).chunk(world, dim)
    rank = torch.distributed.get_rank()
    if rank < len(parts):
        return tuple(parts[rank].shape)
    return tuple(0 if d == dim else n for d, n in enumerate(shape))


def _cases():
    import keras

    from keras_dtensor.hooks import sharded_init

    sharded_init._BLOCK_ELEMENTS = 32  # many blocks per shard
    runs = []
    original_run = sharded_init.LocalDraws.run

    def counted_run(self, *args, **kwargs):
        runs.append(tuple(self.shape))
        return original_run(self, *args, **kwargs)

    sharded_init.LocalDraws.run = counted_run
    world = keras.distribution.get_device_count()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    out = {"cpu_blocks_exact": sharded_init.chunked_draws_match("cpu")}
    for shape, axes in SHAPES:
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["w"] = axes
        distribution = keras.distribution.ModelParallel(layout_map=layout_map)
        for name, kwargs in INITIALIZERS:
            if name == "Orthogonal" and len(shape) != 2:
                continue
            expected = _create(keras, shape, name, kwargs).numpy()
            before = len(runs)
            with distribution.scope():
                v = _create(keras, shape, name, kwargs)
            local = v.value.to_local()
            key = f"{name}{'/sg' if kwargs == 'seed_generator' else ''}"
            out[(shape, key)] = dict(
                equal=bool(
                    np.array_equal(
                        v.value.full_tensor().detach().numpy(), expected
                    )
                ),
                local_shape=tuple(local.shape),
                chunk_shape=_chunk_shape(shape, axes.index("model"), world),
                shard_only=len(runs) > before,
            )
    return out


def test_shards_equal_single_process_values_at_2_ranks():
    results = run_ranks(_cases, 2)
    for rank, out in enumerate(results):
        assert out.pop("cpu_blocks_exact")
        for (shape, name), seen in out.items():
            where = f"rank {rank} {shape} {name}"
            assert seen["equal"], where
            assert seen["local_shape"] == seen["chunk_shape"], where
            # The elementwise initializers never drew the full value.
            assert seen["shard_only"] == (name != "Orthogonal"), where
