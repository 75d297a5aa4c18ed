"""Derived layouts against the maps keras_hub ships, side by side.

    python benchmarks/bench_layouts.py --nproc 2 \\
        --out benchmarks/results-layouts.json

`auto_layout`'s own count per family (`plans`), then each family trained
with both maps: collectives a step and a token, bytes per rank.
"""

import statistics
import sys
import time

import bench_harness as harness
from bench_step import local_bytes
from collectives_off import count_collectives

MOE = dict(moe_intermediate_dim=64, num_experts=4, top_k=2)
# name: (keras_hub class prefix, config beyond COMMON) of every family
# auto_layout is tested on, for `plans`.
PLANNED = {
    "gemma": ("Gemma", dict(head_dim=32)),
    "gemma3": ("Gemma3", dict(head_dim=32, image_size=None)),
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {}),
    "mixtral": ("Mixtral", dict(num_experts=4, top_k=2)),
    "phi3": ("Phi3", {}),
    "qwen": ("Qwen", {}),
    "qwen3": ("Qwen3", dict(head_dim=32)),
    "qwen_moe": ("QwenMoe", dict(MOE, shared_expert_intermediate_dim=128)),
    "qwen3_moe": ("Qwen3Moe", dict(MOE, head_dim=32)),
}
# The families trained with both maps (keras_hub ships a map for each).
FAMILIES = {
    "gemma": ("Gemma", dict(head_dim=32, num_key_value_heads=4)),
    "llama": ("Llama", dict(num_key_value_heads=2)),
    "qwen3_moe": ("Qwen3Moe", dict(MOE, head_dim=32, num_key_value_heads=2)),
}
COMMON = dict(vocabulary_size=4096, num_layers=2, num_query_heads=4)
COMMON.update(hidden_dim=128, intermediate_dim=256)
BATCH, SEQ, STEPS, NEW_TOKENS = 4, 16, 6, 4


def plans(nproc):
    """auto_layout's own count per family: all-reduces forward and
    backward, all-gathers, and the fraction of the weights per rank."""
    import keras

    import keras_dtensor

    mesh = keras.distribution.DeviceMesh(
        (1, nproc), ["batch", "model"], [f"cpu:{i}" for i in range(nproc)]
    )
    out = {}
    for family, (prefix, extra) in PLANNED.items():
        config = {"num_key_value_heads": 2, **extra}
        build = lambda p=prefix, c=config: _build(p, c)  # noqa: E731
        layout = keras_dtensor.auto_layout(build, mesh)
        out[family] = {
            "layers": COMMON["num_layers"],
            "all_reduces_forward": layout.all_reduces_forward,
            "all_reduces_backward": layout.all_reduces_backward,
            "all_gathers_forward": layout.all_gathers_forward,
            "split_weights": sum(1 for e in layout.entries if any(e.axes)),
            "weights": len(layout.entries),
            "bytes_per_rank_fraction": layout.bytes_per_rank
            / layout.bytes_full,
        }
    return out


def _build(prefix, config):
    """keras_hub's causal LM of the family `prefix` at `config`'s sizes."""
    from keras_hub import models

    backbone = getattr(models, prefix + "Backbone")(**COMMON, **config)
    task = getattr(models, prefix + "CausalLM")
    return task(backbone=backbone, preprocessor=None)


def worker(args):
    import keras
    import numpy as np
    import torch.distributed as dist

    import keras_dtensor

    keras.distribution.initialize()
    world = dist.get_world_size()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    prefix, config = FAMILIES[args.family]
    if args.map == "shipped":
        backbone = getattr(__import__("keras_hub").models, prefix + "Backbone")
        layout_map = backbone.get_layout_map(mesh)
    else:
        build = lambda: _build(prefix, config)  # noqa: E731
        layout_map = keras_dtensor.auto_layout_map(build, mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(1, COMMON["vocabulary_size"], (BATCH, SEQ))
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids)}
    y = rng.integers(1, COMMON["vocabulary_size"], (BATCH, SEQ))
    keras.utils.set_random_seed(0)
    with distribution.scope():
        lm = _build(prefix, config)
        lm.compile(
            optimizer=keras.optimizers.AdamW(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        lm.train_on_batch(x, y)
        step = count_collectives(lambda: lm.train_on_batch(x, y))
        times = []
        for _ in range(STEPS):
            dist.barrier()
            start = time.perf_counter()
            lm.train_on_batch(x, y)
            times.append((time.perf_counter() - start) * 1e3)
        mask = np.zeros_like(ids, bool)
        mask[:, : SEQ - NEW_TOKENS] = True
        prompt = {"token_ids": x["token_ids"], "padding_mask": mask}
        lm.generate(prompt, stop_token_ids=None)  # compiles the sampler
        out = {}
        generate = count_collectives(
            lambda: out.update(lm.generate(prompt, stop_token_ids=None))
        )

    result = {
        "step": step,
        "generate_per_token": {k: n / NEW_TOKENS for k, n in generate.items()},
        "param_bytes": local_bytes([v.value for v in lm.weights]),
        "optimizer_bytes": local_bytes(
            [v.value for v in lm.optimizer.variables]
        ),
        "step_ms": statistics.median(times),
        "tokens": np.asarray(out["token_ids"]).tolist(),
    }
    harness.write_result(args.result_dir, result)


def main(argv=None):
    parser = harness.parser(__doc__, nproc=2)
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--map", choices=["shipped", "auto"])
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    command = "OMP_NUM_THREADS=1 python benchmarks/bench_layouts.py "
    command += f"--nproc {args.nproc} --out {args.out}"
    result = harness.record(command, nproc=args.nproc, runs={})
    result["plans"] = plans(args.nproc)
    for family in args.families.split(","):
        for layout in ("shipped", "auto"):
            flags = [f"--family={family}", f"--map={layout}"]
            ranks = harness.launch(__file__, args.nproc, flags)
            run = {
                k: ranks[0][k] for k in ("step", "generate_per_token", "tokens")
            }
            for key in ("param_bytes", "optimizer_bytes", "step_ms"):
                run[key] = max(r[key] for r in ranks)
            result["runs"].setdefault(family, {})[layout] = run
    harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
