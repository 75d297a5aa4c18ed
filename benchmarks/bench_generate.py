"""Decoding under ModelParallel against native torch tensor parallelism.

    python benchmarks/bench_generate.py --rounds 3

keras_hub's `GemmaCausalLM.generate` against a torch decoder of the same
sizes and split, each also in one process; every split model must
generate its one-process tokens. Target: kd-MP ÷ torch TP against
Keras ÷ torch, per round.
"""

import sys
import time

import bench_harness as harness

VARIANTS = {
    "torch_single": 1,
    "keras_single": 1,
    "torch_tp": 2,
    "kd_mp": 2,
    "kd_mp_dtensor": 2,  # every op a DTensor (KERAS_DTENSOR_LOCAL_MODEL=0)
    "torch_tp_whole_embedding": 2,
    "torch_tp_no_collectives": 2,
    "kd_mp_no_collectives": 2,
}
RATIOS = (
    ("keras_over_torch_single", "keras_single", "torch_single"),
    ("kd_mp_over_tp", "kd_mp", "torch_tp"),
    ("kd_mp_local_over_dtensor", "kd_mp", "kd_mp_dtensor"),
)
CONFIG = dict(
    vocabulary_size=256,
    num_layers=4,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=128,
    intermediate_dim=512,  # Gemma's gate and up are half of it each
    head_dim=32,
)
BATCH, PROMPT, LENGTH = 2, 8, 32


def _prompt():
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG["vocabulary_size"], size=(BATCH, LENGTH))
    mask = np.zeros((BATCH, LENGTH), bool)
    mask[:, :PROMPT] = True
    return tokens.astype("int32"), mask


def _torch_decoder():
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate

    c = CONFIG
    width, head = c["hidden_dim"], c["head_dim"]
    inner = c["num_query_heads"] * head
    ffw = c["intermediate_dim"] // 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.RMSNorm(width)
            self.q = nn.Linear(width, inner, bias=False)
            self.k = nn.Linear(width, inner, bias=False)
            self.v = nn.Linear(width, inner, bias=False)
            self.o = nn.Linear(inner, width, bias=False)
            self.norm2 = nn.RMSNorm(width)
            self.gate = nn.Linear(width, ffw, bias=False)
            self.up = nn.Linear(width, ffw, bias=False)
            self.down = nn.Linear(ffw, width, bias=False)

        def forward(self, x, cache, pos):
            b, t, _ = x.shape
            h = self.norm1(x)
            # Local heads under TP: the column split's output is local.
            q, k, v = (
                layer(h).view(b, t, -1, head).transpose(1, 2)
                for layer in (self.q, self.k, self.v)
            )
            if cache[0] is None:
                cache[0] = k.new_zeros(b, k.shape[1], LENGTH, head)
                cache[1] = v.new_zeros(b, v.shape[1], LENGTH, head)
            cache[0][:, :, pos : pos + t] = k
            cache[1][:, :, pos : pos + t] = v
            keys, values = (c[:, :, : pos + t] for c in cache)
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=t > 1
            )
            x = x + self.o(out.transpose(1, 2).reshape(b, t, -1))
            h = self.norm2(x)
            return x + self.down(F.gelu(self.gate(h)) * self.up(h))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(c["vocabulary_size"], width)
            self.blocks = nn.ModuleList(Block() for _ in range(c["num_layers"]))
            self.norm = nn.RMSNorm(width)

        def forward(self, tokens, caches, pos):
            x = self.embed(tokens)
            for block, cache in zip(self.blocks, caches, strict=True):
                x = block(x, cache, pos)
            h, weight = self.norm(x)[:, -1], self.embed.weight
            if isinstance(weight, DTensor):  # split by vocabulary rows
                # The tied head as a column split with a replicated
                # output: logits' shards gathered for the sampler.
                h = DTensor.from_local(h, weight.device_mesh, [Replicate()])
                return (h @ weight.T).full_tensor()
            return h @ weight.T

    torch.manual_seed(0)
    return Decoder()


def _run_torch(variant, calls):
    import torch

    device = torch.device("cuda" if harness.cuda() else "cpu")
    model = _torch_decoder().to(device)  # replicated parts too, before TP
    if variant.startswith("torch_tp"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel
        from torch.distributed.tensor.parallel import RowwiseParallel
        from torch.distributed.tensor.parallel import parallelize_module

        dist.init_process_group("nccl" if harness.cuda() else "gloo")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        plan = {}
        for i in range(CONFIG["num_layers"]):
            for name in ("q", "k", "v", "gate", "up"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("o", "down"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        if variant != "torch_tp_whole_embedding":  # keras_hub's map splits it
            plan["embed"] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            )
        model = parallelize_module(model, mesh, plan)
    tokens, _ = _prompt()
    prompt = torch.as_tensor(
        tokens[:, :PROMPT], dtype=torch.long, device=device
    )

    @torch.no_grad()
    def generate():
        caches = [[None, None] for _ in range(CONFIG["num_layers"])]
        logits = model(prompt, caches, 0)
        out = [logits.argmax(-1)]
        for pos in range(PROMPT, LENGTH - 1):
            logits = model(out[-1][:, None], caches, pos)
            out.append(logits.argmax(-1))
        return torch.stack(out, 1)

    return _timed(generate, calls, variant)


def _run_keras(variant, calls):
    import keras
    import keras_hub

    import keras_dtensor  # noqa: F401

    if variant.startswith("kd_mp"):
        keras.distribution.initialize()
        world = keras.distribution.get_device_count()
        mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map)
        keras.distribution.set_distribution(distribution)  # batch: axis 0
    keras.utils.set_random_seed(0)
    lm = keras_hub.models.GemmaCausalLM(
        backbone=keras_hub.models.GemmaBackbone(**CONFIG), preprocessor=None
    )
    lm.compile(sampler="greedy")
    tokens, mask = _prompt()
    prompt = {"token_ids": tokens, "padding_mask": mask}
    generate = lambda: lm.generate(prompt, stop_token_ids=None)  # noqa: E731
    return _timed(generate, calls, variant)


def _timed(generate, calls, variant):
    from collectives_off import collectives_off  # beside this script
    from collectives_off import count_collectives

    generate()  # first call: checks, caches
    if variant.endswith("_no_collectives"):
        collectives_off()
    times = []
    for _ in range(calls):
        harness.sync()
        start = time.perf_counter()
        out = generate()
        harness.sync()  # torch's tokens stay on the GPU: wait for them
        times.append(time.perf_counter() - start)
    if isinstance(out, dict):  # keras_hub's: the prompt and the new tokens
        out = out["token_ids"][:, PROMPT:]
    return {
        "ms": 1000 * min(times),
        "tokens": out.tolist(),
        "collectives": count_collectives(generate),  # one more call
    }


def worker(args):
    harness.start_worker()
    run = _run_keras if args.variant.startswith(("keras", "kd")) else _run_torch
    harness.write_result(args.result_dir, run(args.variant, args.calls))


def main(argv=None):
    parser = harness.parser(__doc__, rounds=3, nproc=2, device=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)

    def run(variant):
        nproc = 1 if VARIANTS[variant] == 1 else args.nproc
        flags = [f"--variant={variant}", f"--calls={args.calls}"]
        env = {"KERAS_DTENSOR_LOCAL_MODEL": "0"} if "dtensor" in variant else {}
        return harness.launch(__file__, nproc, flags, env, args.device)

    runs = harness.rounds(args.rounds, list(VARIANTS), run)
    # Each round's figure is its slowest rank's.
    round_ms = {v: [max(r["ms"] for r in rs) for rs in runs[v]] for v in runs}
    ratios = {
        name: harness.per_round(round_ms[a], round_ms[b])[0]
        for name, a, b in RATIOS
    }
    # Each split model generates its one-process tokens.
    same = all(
        rs[0]["tokens"] == one[0]["tokens"]
        for split, single in (
            ("torch_tp", "torch_single"),
            ("torch_tp_whole_embedding", "torch_single"),
            ("kd_mp", "keras_single"),
            ("kd_mp_dtensor", "keras_single"),
        )
        for rs, one in zip(runs[split], runs[single], strict=True)
    )
    collectives = {v: rs[-1][0]["collectives"] for v, rs in runs.items()}
    off = not any(c for v, c in collectives.items() if "_no_coll" in v)
    result = {"device": args.device, "nproc": args.nproc, "round_ms": round_ms}
    result["rss_mb"] = {
        v: max(r["rss_mb"] for rs in runs[v] for r in rs) for v in runs
    }
    result.update(ratios=ratios, same_tokens=same, collectives=collectives)
    result["no_collectives_ran_none"] = off
    harness.write_json(args.out, result)
    return 0 if same and off else 1


if __name__ == "__main__":
    sys.exit(main())
