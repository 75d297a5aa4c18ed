"""Derived layouts against the maps keras_hub ships, side by side.

For Gemma, Llama and Qwen3-MoE (keras_hub ships a `get_layout_map` for
each), the causal LM is trained under ModelParallel on a (1, N) mesh once
with keras_hub's map and once with `keras_dtensor.auto_layout_map`, in
the same run, each in fresh processes (`torch.distributed.run`, one
thread each):

    python benchmarks/bench_layouts.py --nproc 2 \\
        --out benchmarks/results-layouts.json

First, `auto_layout`'s own count for every family it is tested on
(`plans`). Then, per family and map: the collectives of one training
step and of one generated token (counted at dispatch, by kind), the
parameter and optimizer bytes per rank (the local shards), and the median
step time (CPU: information only). Goal: the derived map needs no more
collectives than the shipped one, and no more bytes.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "torch")

FAMILIES = {
    # name: (backbone, causal LM, config); small but not tiny: the
    # embedding is split by vocabulary under both maps
    "gemma": (
        "GemmaBackbone",
        "GemmaCausalLM",
        dict(head_dim=32, num_key_value_heads=4),
    ),
    "llama": ("LlamaBackbone", "LlamaCausalLM", dict(num_key_value_heads=2)),
    "qwen3_moe": (
        "Qwen3MoeBackbone",
        "Qwen3MoeCausalLM",
        dict(
            head_dim=32,
            num_key_value_heads=2,
            moe_intermediate_dim=64,
            num_experts=4,
            top_k=2,
        ),
    ),
}
COMMON = dict(
    vocabulary_size=4096,
    num_layers=2,
    num_query_heads=4,
    hidden_dim=128,
    intermediate_dim=256,
)
BATCH, SEQ, STEPS, NEW_TOKENS = 4, 16, 6, 4
# Every family auto_layout is tested on, for the per-family plan table
# (derived in one process, nothing allocated): name -> (task, backbone,
# config).
PLANNED = {
    "gemma": ("GemmaCausalLM", "GemmaBackbone", dict(head_dim=32)),
    "gemma3": (
        "Gemma3CausalLM",
        "Gemma3Backbone",
        dict(head_dim=32, image_size=None),
    ),
    "llama": ("LlamaCausalLM", "LlamaBackbone", {}),
    "mistral": ("MistralCausalLM", "MistralBackbone", {}),
    "mixtral": (
        "MixtralCausalLM",
        "MixtralBackbone",
        dict(num_experts=4, top_k=2),
    ),
    "phi3": ("Phi3CausalLM", "Phi3Backbone", {}),
    "qwen": ("QwenCausalLM", "QwenBackbone", {}),
    "qwen3": ("Qwen3CausalLM", "Qwen3Backbone", dict(head_dim=32)),
    "qwen_moe": (
        "QwenMoeCausalLM",
        "QwenMoeBackbone",
        dict(
            moe_intermediate_dim=64,
            num_experts=4,
            top_k=2,
            shared_expert_intermediate_dim=128,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeCausalLM",
        "Qwen3MoeBackbone",
        dict(head_dim=32, moe_intermediate_dim=64, num_experts=4, top_k=2),
    ),
}


def plans(nproc):
    """auto_layout's own count per family: all-reduces forward and
    backward, all-gathers, and the fraction of the weights per rank."""
    import keras
    import keras_hub

    import keras_dtensor

    mesh = keras.distribution.DeviceMesh(
        (1, nproc), ["batch", "model"], [f"cpu:{i}" for i in range(nproc)]
    )
    out = {}
    for family, (task, backbone, extra) in PLANNED.items():

        def build(task=task, backbone=backbone, extra=extra):
            config = {**COMMON, "num_key_value_heads": 2, **extra}
            model = getattr(keras_hub.models, backbone)(**config)
            return getattr(keras_hub.models, task)(
                backbone=model, preprocessor=None
            )

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


def _build(family):
    import keras_hub

    backbone_cls, lm_cls, extra = FAMILIES[family]
    backbone = getattr(keras_hub.models, backbone_cls)(**COMMON, **extra)
    return getattr(keras_hub.models, lm_cls)(
        backbone=backbone, preprocessor=None
    )


def _counter():
    """A dispatch mode counting collectives by kind (torch's
    `CommDebugMode` also tracks modules, which Keras's nested layer calls
    trip up)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace = getattr(func, "namespace", "")
            if "c10d" in namespace:
                name = func.overloadpacket.__name__.strip("_")
                if name not in ("wait_tensor", "wait", "wrap_tensor_autograd"):
                    self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count()


def worker(args):
    import keras
    import numpy as np
    import torch.distributed as dist

    import keras_dtensor

    keras.distribution.initialize()
    world = dist.get_world_size()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    backbone_cls = getattr(
        __import__("keras_hub").models, FAMILIES[args.family][0]
    )
    if args.map == "shipped":
        layout_map = backbone_cls.get_layout_map(mesh)
    else:
        layout_map = keras_dtensor.auto_layout_map(
            lambda: _build(args.family), mesh
        )
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(1, COMMON["vocabulary_size"], (BATCH, SEQ))
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids)}
    y = rng.integers(1, COMMON["vocabulary_size"], (BATCH, SEQ))
    keras.utils.set_random_seed(0)
    with distribution.scope():
        lm = _build(args.family)
        lm.compile(
            optimizer=keras.optimizers.AdamW(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        lm.train_on_batch(x, y)
        with _counter() as comm:
            lm.train_on_batch(x, y)
        step = comm.counts
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
        with _counter() as comm:
            tokens = lm.generate(prompt, stop_token_ids=None)["token_ids"]
        generate = comm.counts

    def local_bytes(variables):
        total = 0
        for v in variables:
            value = v.value
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
        return total

    result = {
        "rank": dist.get_rank(),
        "step": step,
        "generate_per_token": {k: n / NEW_TOKENS for k, n in generate.items()},
        "param_bytes": local_bytes(lm.weights),
        "optimizer_bytes": local_bytes(lm.optimizer.variables),
        "step_ms": statistics.median(times),
        "tokens": np.asarray(tokens).tolist(),
    }
    path = os.path.join(args.result_dir, f"rank{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(result, f)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "mode", nargs="?", default="bench", choices=["bench", "worker"]
    )
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--map", choices=["shipped", "auto"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    from bench_step import run_workers

    runs = {}
    planned = plans(args.nproc)
    for family in args.families.split(","):
        for layout in ("shipped", "auto"):
            ranks = run_workers(
                __file__,
                args.nproc,
                [f"--family={family}", f"--map={layout}"],
                {"CUDA_VISIBLE_DEVICES": ""},
                f"{family} {layout}",
            )
            runs.setdefault(family, {})[layout] = {
                "step": ranks[0]["step"],
                "generate_per_token": ranks[0]["generate_per_token"],
                "param_bytes": max(r["param_bytes"] for r in ranks),
                "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),
                "step_ms": max(r["step_ms"] for r in ranks),
                "tokens": ranks[0]["tokens"],
            }
    print(
        "| family | map | step collectives | per token "
        "| params+opt MiB/rank | step ms |"
    )
    print("|---|---|---|---|---|---|")
    for family, maps in runs.items():
        for layout, r in maps.items():
            print(
                f"| {family} | {layout} | {r['step']} | "
                f"{r['generate_per_token']} | "
                f"{(r['param_bytes'] + r['optimizer_bytes']) / 2**20:.2f} | "
                f"{r['step_ms']:.1f} |"
            )
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "commit": commit,
                    "nproc": args.nproc,
                    "runs": runs,
                    "plans": planned,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
