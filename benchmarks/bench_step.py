"""Step time, memory and communication: keras-dtensor against native torch.

    python benchmarks/bench_step.py --rounds 6 --out benchmarks/results.json

Every variant (`VARIANTS`) on every model (`MODELS`) in fresh processes,
round by round; each ratio (`RATIOS`) is taken within its round and held
against Keras single over torch single (`_targets`).
"""

import os
import statistics
import sys
import time

import bench_harness as harness

OFF = "_no_collectives"
# (native, keras-dtensor) names of each distributed pair.
_PAIRS = ("ddp", "dp"), ("tp", "mp"), ("fsdp2", "fsdp")
# Ordered so that each target's two variants run back to back.
VARIANTS = [
    f"{side}_single{share}"
    for share in ("", "_local", "_pair")
    for side in ("torch", "keras")
]
VARIANTS += [v for t, k in _PAIRS for v in (f"torch_{t}", f"kd_{k}")]
VARIANTS += [v + OFF for v in VARIANTS[6:]]
LOCAL_OFF = "_dtensor"
VARIANTS.insert(VARIANTS.index("kd_mp") + 1, "kd_mp" + LOCAL_OFF)
_PAIR_EXTRA_STEPS = 10  # see `_pair_start`
# (target name, numerator, denominator) of the step-time ratios; the
# suffix of the ratios held against each Keras ÷ torch reference.
REFERENCES = {"": "single", "_vs_local": "local", "_vs_pair": "pair"}
RATIOS = [
    (f"keras_over_torch_{r}", f"keras_single{s}", f"torch_single{s}")
    for r, s in (("single", ""), ("local", "_local"), ("pair", "_pair"))
]
RATIOS += [
    (f"kd_{k}_over_{t}{off}", f"kd_{k}{off}", f"torch_{t}{off}")
    for off in ("", OFF)
    for t, k in _PAIRS
]
RATIOS += [("kd_mp_local_over_dtensor", "kd_mp", "kd_mp" + LOCAL_OFF)]
LABELS = ("per_round", "holds_in_rounds"), ("extra_ms_per_round", "extra_holds")
MODELS = {
    "mlp": dict(width=1024, layers=4, batch=64),
    "transformer": dict(
        d_model=256, heads=4, mlp=1024, seq=128, batch=8, blocks=2
    ),
    "transformer_small": dict(
        d_model=32, heads=4, mlp=128, seq=16, batch=8, blocks=2
    ),
}


# ----------------------------------------------------------------- torch
def _torch_mlp(cfg):
    import torch

    body = []
    for _ in range(cfg["layers"]):
        body += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.ReLU()]
    return torch.nn.Sequential(*body[:-1])


def _torch_transformer(cfg):
    import torch
    import torch.nn.functional as F

    d, h = cfg["d_model"], cfg["heads"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (
                torch.nn.Linear(d, d) for _ in range(4)
            )
            self.ln1 = torch.nn.LayerNorm(d)
            self.up = torch.nn.Linear(d, cfg["mlp"])
            self.down = torch.nn.Linear(cfg["mlp"], d)
            self.ln2 = torch.nn.LayerNorm(d)

        def forward(self, x):
            b, s, _ = x.shape
            head = d // h

            def heads(t):  # works on local shards: heads = width / head
                return t.view(b, s, -1, head).transpose(1, 2)

            a = F.scaled_dot_product_attention(
                heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
            )
            a = self.o(a.transpose(1, 2).reshape(b, s, -1))
            x = self.ln1(x + a)
            return self.ln2(x + self.down(F.relu(self.up(x))))

    return torch.nn.Sequential(*[Block() for _ in range(cfg["blocks"])])


def _tp_plan(model_name, model):
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    if model_name == "mlp":  # Linear layers at even places, alternating
        styles = ColwiseParallel, RowwiseParallel
        return {str(i): styles[i // 2 % 2]() for i in range(0, len(model), 2)}
    plan = {}
    for i in range(len(model)):
        for name in ("q", "k", "v", "up"):
            plan[f"{i}.{name}"] = ColwiseParallel()
        for name in ("o", "down"):
            plan[f"{i}.{name}"] = RowwiseParallel()
    return plan


def _data(model_name, cfg):
    import torch

    g = torch.Generator().manual_seed(0)
    if model_name == "mlp":
        shape = (cfg["batch"], cfg["width"])
    else:
        shape = (cfg["batch"], cfg["seq"], cfg["d_model"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def local_bytes(tensors):
    """The bytes of `tensors`' local shards (None skipped)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if t is not None)


def adam(params, lr):
    """torch's foreach Adam, DTensors and plain tensors in separate groups."""
    import torch
    from torch.distributed.tensor import DTensor

    groups = [
        [p for p in params if isinstance(p, DTensor) == d] for d in (1, 0)
    ]
    groups = [{"params": g} for g in groups if g]
    return torch.optim.Adam(groups, lr=lr, foreach=True)


def _config(variant, model_name):
    cfg = dict(MODELS[model_name])
    if variant.endswith(("_local", "_pair")):
        cfg["batch"] //= int(os.environ["BENCH_NPROC"])
    return cfg


def _pair_start(variant):
    """For "_pair" variants: every process starts together, and ranks
    other than 0 run extra untimed steps, so rank 0 never finishes alone."""
    if not variant.endswith("_pair"):
        return 0
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return 0 if rank == 0 else _PAIR_EXTRA_STEPS


def _run_torch(variant, model_name, steps, warmup):
    import torch
    import torch.distributed as dist
    from collectives_off import collectives_off  # beside this script
    from step_counts import StepCounts
    from torch.distributed.tensor.debug import CommDebugMode

    off = variant.endswith(OFF)
    variant = variant.removesuffix(OFF)
    cfg = _config(variant, model_name)
    torch.manual_seed(0)
    build = _torch_mlp if model_name == "mlp" else _torch_transformer
    model = build(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    x, y = _data(model_name, cfg)
    device = "cpu"
    if harness.cuda():
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        torch.cuda.set_device(device)
        model, x, y = model.to(device), x.to(device), y.to(device)
    if not variant.startswith("torch_single"):
        dist.init_process_group("nccl" if harness.cuda() else "gloo")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.split(":")[0], (world,))
        rank = dist.get_rank()
        if variant == "torch_ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        elif variant == "torch_tp":
            from torch.distributed.tensor.parallel import parallelize_module

            model = parallelize_module(model, mesh, _tp_plan(model_name, model))
        elif variant == "torch_fsdp2":
            from torch.distributed.fsdp import fully_shard

            for module in model:
                if any(p.requires_grad for p in module.parameters()):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    optimizer = adam(list(model.parameters()), 1e-4)

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()

    times, cpu = [], []
    extra = _pair_start(variant)
    for i in range(warmup + steps + extra):
        if off and i == warmup:
            collectives_off(model if variant == "torch_ddp" else None)
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        harness.sync()
        if warmup <= i < warmup + steps:
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    with StepCounts() as counts:
        step()
    comm = CommDebugMode()
    with comm:
        step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    return {
        "times": times,
        "cpu_times": cpu,
        "bytes": local_bytes(list(model.parameters()) + state),
        "comms": {str(k): v for k, v in comm.get_comm_counts().items()},
        "counts": counts.as_dict(),
    }


# ----------------------------------------------------------------- keras
def _keras_model(keras, model_name, cfg):
    if model_name == "mlp":
        inputs = keras.Input((cfg["width"],))
        h = inputs
        for i in range(cfg["layers"]):
            act = "relu" if i < cfg["layers"] - 1 else None
            h = keras.layers.Dense(cfg["width"], act, name=f"dense_{i}")(h)
        return keras.Model(inputs, h)
    d = cfg["d_model"]
    inputs = keras.Input((cfg["seq"], d))
    h = inputs
    for i in range(cfg["blocks"]):
        a = keras.layers.MultiHeadAttention(
            cfg["heads"],
            d // cfg["heads"],
            dropout=cfg.get("dropout", 0.0),
            name=f"mha_{i}",
        )(h, h)
        h = keras.layers.LayerNormalization(name=f"ln1_{i}")(h + a)
        f = keras.layers.Dense(cfg["mlp"], activation="relu", name=f"up_{i}")(h)
        f = keras.layers.Dense(d, name=f"down_{i}")(f)
        h = keras.layers.LayerNormalization(name=f"ln2_{i}")(h + f)
    return keras.Model(inputs, h)


def _keras_layouts(model_name, variant):
    if variant == "kd_fsdp":
        if model_name == "mlp":
            return {"dense_.*/kernel": ("batch", None)}
        return {
            "mha_.*/(query|key|value)/kernel": ("batch", None, None),
            "mha_.*/attention_output/kernel": ("batch", None, None),
            "(up|down)_.*/kernel": ("batch", None),
        }
    if model_name == "mlp":  # the TP variant's column/row split
        return {
            "dense_[02]/kernel": (None, "model"),
            "dense_[02]/bias": ("model",),
            "dense_[13]/kernel": ("model", None),
        }
    return {
        "mha_.*/(query|key|value)/kernel": (None, "model", None),
        "mha_.*/(query|key|value)/bias": ("model", None),
        "mha_.*/attention_output/kernel": ("model", None, None),
        "up_.*/kernel": (None, "model"),
        "up_.*/bias": ("model",),
        "down_.*/kernel": ("model", None),
    }


def _count_p2p():
    """Counts `batch_isend_irecv` calls, which CommDebugMode does not see
    (DataParallel's gradients reduced to their owners), until the returned
    function restores it and gives the count."""
    import torch.distributed as dist

    original, calls = dist.batch_isend_irecv, []

    def counted(ops):
        if not getattr(original, "collectives_off", False):
            calls.append(1)
        return original(ops)

    def close():
        dist.batch_isend_irecv = original
        return {"send/recv batch": len(calls)} if calls else {}

    dist.batch_isend_irecv = counted
    return close


def _run_keras(variant, model_name, steps, warmup):
    import keras  # noqa: I001
    import numpy as np
    from collectives_off import collectives_off  # beside this script
    from step_counts import StepCounts
    from torch.distributed.tensor.debug import CommDebugMode

    import keras_dtensor  # noqa: F401

    off = variant.endswith(OFF)
    variant = variant.removesuffix(OFF).removesuffix(LOCAL_OFF)
    cfg = _config(variant, model_name)
    if variant == "kd_dp":
        keras.distribution.initialize()
        distribution = keras.distribution.DataParallel()
        keras.distribution.set_distribution(distribution)
    elif not variant.startswith("keras_single"):
        # TP: the batch replicated over "model", as in torch TP; FSDP:
        # weights and batch both sharded over "batch".
        keras.distribution.initialize()
        world = keras.distribution.get_device_count()
        shape = (1, world) if variant == "kd_mp" else (world,)
        layouts = _keras_layouts(model_name, variant)
        harness.model_parallel(keras, layouts, shape)
    keras.utils.set_random_seed(0)
    model = _keras_model(keras, model_name, cfg)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    x, y = (t.numpy() for t in _data(model_name, cfg))

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.cpu = [], []

        def on_train_batch_begin(self, batch, logs=None):
            if off and batch == warmup:
                collectives_off()
            harness.sync()
            if batch == warmup + steps:  # one step counted, untimed
                self.counts = StepCounts().__enter__()
            if batch == repeats - 1:  # the last step: count collectives
                self.comm = CommDebugMode().__enter__()
                self.p2p = _count_p2p()
            self.start = time.perf_counter(), time.thread_time()

        def on_train_batch_end(self, batch, logs=None):
            harness.sync()
            wall, cpu = time.perf_counter(), time.thread_time()
            if batch == warmup + steps:
                self.counts.__exit__(None, None, None)
            if batch == repeats - 1:
                self.comm.__exit__(None, None, None)
                self.comms = {
                    str(k): v for k, v in self.comm.get_comm_counts().items()
                }
                self.comms.update(self.p2p())
            elif warmup <= batch < warmup + steps:
                self.times.append(wall - self.start[0])
                self.cpu.append(cpu - self.start[1])

    timer = Timer()
    repeats = warmup + steps + 2 + _pair_start(variant)
    xs, ys = (np.concatenate([a] * repeats) for a in (x, y))
    fit = dict(batch_size=len(x), shuffle=False, verbose=0, callbacks=[timer])
    model.fit(xs, ys, **fit)
    held = [v.value for v in model.variables + model.optimizer.variables]
    return {
        "times": timer.times,
        "cpu_times": timer.cpu,
        "bytes": local_bytes(held),
        "comms": timer.comms,
        "counts": timer.counts.as_dict(),
    }


def worker(args):
    harness.start_worker()
    run = _run_keras if args.variant.startswith(("keras", "kd")) else _run_torch
    result = run(args.variant, args.model, args.steps, args.warmup)
    harness.write_result(args.result_dir, result)


def _processes(variant, args):
    single = "_single" in variant and not variant.endswith("_pair")
    return 1 if single else args.nproc


def _launch(model, variant, args):
    env = {"BENCH_NPROC": str(args.nproc)}
    if variant.endswith(LOCAL_OFF):
        env["KERAS_DTENSOR_LOCAL_MODEL"] = "0"
    arguments = [f"--variant={variant}", f"--model={model}"]
    arguments += [f"--steps={args.steps}", f"--warmup={args.warmup}"]
    nproc = _processes(variant, args)
    return harness.launch(__file__, nproc, arguments, env, args.device)


def main(argv=None):
    parser = harness.parser(__doc__, rounds=3, nproc=2, device=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--models", default="mlp,transformer")
    default = ",".join(v for v in VARIANTS if not v.endswith((OFF, LOCAL_OFF)))
    parser.add_argument("--variants", default=default, help="default: all")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    started, models = time.time(), args.models.split(",")

    pairs = [(model, variant) for model in models for variant in variants]
    raw = harness.rounds(args.rounds, pairs, lambda p: _launch(*p, args))
    table = {m: {v: _row(raw[m, v], v, args) for v in variants} for m in models}
    # The diagnostics must have run without any collective once warm.
    ran = {
        f"{model}/{variant}": row["comms_per_step"]
        for model, rows in table.items()
        for variant, row in rows.items()
        if variant.endswith(OFF) and row["comms_per_step"]
    }
    summary = {
        "table": table,
        "no_collectives_ran_none": not ran,
        "seconds": time.time() - started,
        "rounds": args.rounds,
        "steps": args.steps,
        "device": args.device,
        "targets": {m: _targets(rows, args) for m, rows in table.items()},
    }
    harness.write_json(args.out, summary)
    for model, targets in summary["targets"].items():
        for name, value in targets.items():
            if isinstance(value, dict):
                held = _held(value, "holds_in_rounds")
                rounds = " ".join(f"{r:.2f}" for r in value["per_round"])
                print(
                    f"{model} {name}: {value['median_of_rounds']:.2f} "
                    f"({rounds}) held {held or '-'}"
                )
    if ran:
        print(f"collectives ran in no-collectives variants: {ran}")
    return 1 if ran else 0


def _row(runs, variant, args):
    """A variant's figures over its rounds (rank 0's times)."""
    times = [t for run in runs for t in run[0]["times"]]
    cpu = [t for run in runs for t in run[0]["cpu_times"]]
    return {
        "median_ms": 1000 * statistics.median(times),
        "cpu_median_ms": 1000 * statistics.median(cpu),  # host work
        "min_ms": 1000 * min(times),
        "round_median_ms": [
            1000 * statistics.median(run[0]["times"]) for run in runs
        ],
        "rss_mb": max(r["rss_mb"] for run in runs for r in run),
        "bytes_per_rank": max(r["bytes"] for r in runs[-1]),
        "comms_per_step": runs[-1][0]["comms"],
        "counts_per_step": runs[-1][0]["counts"],
        "processes": _processes(variant, args),
    }


def _targets(rows, args):
    """Each ratio within every round and its median over rounds, in ms too;
    `holds_in_rounds`/`extra_holds` count the rounds in which a distributed
    variant's ratio/extra ms stayed within Keras's own over torch (at the
    global batch; `_vs_local`, `_vs_pair`: at one process's share)."""
    targets = {}
    for name, a, b in RATIOS:
        if {a, b} <= rows.keys():
            ms = rows[a]["round_median_ms"], rows[b]["round_median_ms"]
            per_round, median = harness.per_round(*ms)
            extra, extra_median = harness.per_round(*ms, lambda x, y: x - y)
            targets[name] = {
                "pooled": rows[a]["median_ms"] / rows[b]["median_ms"],
                "median_of_rounds": median,
                "per_round": per_round,
                "extra_ms_median_of_rounds": extra_median,
                "extra_ms_per_round": extra,
            }
    checked = [name for name, _, _ in RATIOS[3:]]
    for suffix, reference in REFERENCES.items():
        allowed = targets.get(f"keras_over_torch_{reference}")
        for name in checked if allowed else ():
            for key, label in LABELS:
                if name in targets:
                    pairs = zip(targets[name][key], allowed[key], strict=True)
                    held = [x <= limit for x, limit in pairs]
                    targets[name][label + suffix] = f"{sum(held)}/{len(held)}"
    if {"kd_fsdp", "keras_single"} <= rows.keys():
        full = rows["keras_single"]["bytes_per_rank"] / args.nproc
        kd = rows["kd_fsdp"]["bytes_per_rank"]
        targets["kd_fsdp_bytes_over_full_div_n"] = kd / full
    return targets


def _held(value, label):
    held = [
        value.get(label + suffix) for suffix in ("", "_vs_local", "_vs_pair")
    ]
    return " / ".join(h or "-" for h in held) if any(held) else ""


if __name__ == "__main__":
    sys.exit(main())
