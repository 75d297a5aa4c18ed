"""Peak memory while a sharded model initializes, against its steady state.

    PYTHONHASHSEED=0 OMP_NUM_THREADS=1 python -m torch.distributed.run \\
        --standalone --nproc_per_node=2 benchmarks/bench_init.py

A 400k x 128 fp32 embedding sharded over "model" with its two Adam slots.
Prints per rank the resident MB before the model, the peak during its
initialization and the steady RSS after, and peak over steady.
"""

import argparse
import gc
import os
import sys

import bench_harness as harness

VOCAB, WIDTH = 400_000, 128


def _rss_mb():
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    sys.modules.setdefault("tensorflow", None)  # see bench_harness.start_worker
    import keras  # noqa: I001
    import torch.distributed as dist

    import keras_dtensor  # noqa: F401

    keras.distribution.initialize()
    world = keras.distribution.get_device_count()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embeddings"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    gc.collect()
    before = _rss_mb()
    layer = keras.layers.Embedding(VOCAB, WIDTH)
    layer.build((None,))
    optimizer = keras.optimizers.Adam()
    optimizer.build(layer.trainable_variables)
    gc.collect()
    steady = _rss_mb()
    peak = harness.peak_rss_mb()
    local = layer.embeddings.value.to_local()
    shard_mb = local.numel() * local.element_size() / 2**20
    for rank in range(world):
        if rank == dist.get_rank():
            print(
                f"rank {rank}: shard {shard_mb:.0f} MB x 3, before "
                f"{before:.0f}, peak {peak:.0f}, steady {steady:.0f} MB; "
                f"peak over steady: model memory "
                f"{(peak - before) / (steady - before):.2f}x, process "
                f"{peak / steady:.2f}x",
                flush=True,
            )
        dist.barrier()


if __name__ == "__main__":
    main()
