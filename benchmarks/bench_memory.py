"""Per-rank memory of training and checkpointing: keras-dtensor against torch.

    python benchmarks/bench_memory.py                 # models a, b, c; 4 ranks
    python benchmarks/bench_memory.py --models c --reference  # + one process

Each side of each model (`MODELS`) runs in its own fresh processes, so
neither side's allocations reach the other's figures; every figure is MiB
above a baseline taken after imports and the group's start (`_Probe`).
"""

import argparse
import ctypes
import gc
import itertools
import os
import sys
import tempfile
import time

import bench_harness as harness
import bench_step

_MIB = 2**20
MODELS = {
    "a": dict(kind="embed", vocab=1_000_000, dim=128, seq=4, units=256),
    "c": dict(kind="transformer", d_model=1024, heads=8, mlp=4096, seq=32),
    "d": dict(kind="fsdp", width=2048, layers=8),
}
MODELS["b"] = dict(MODELS["a"], vocab_tp=1)
MODELS["c"]["blocks"] = 2
SIDES = ("native", "kd")


class _Probe:
    """Per-rank figures, relative to the baseline taken at construction."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.figures = dist, {}
        gc.collect()
        dist.barrier()
        self.base = harness.status()["VmRSS"]

    def start(self):
        gc.collect()
        self.dist.barrier()
        harness.reset_peak()
        return time.perf_counter()

    def rss(self):
        return (harness.status()["VmRSS"] - self.base) / _MIB

    def peak(self):
        return (harness.status()["VmHWM"] - self.base) / _MIB

    def end_fit(self):
        self.figures.update(fit_peak=self.peak(), steady=self.rss())
        gc.collect()
        self.trim()
        self.figures["steady_trimmed"] = self.rss()

    def trim(self):  # glibc's arena memory back to the OS
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    def timed(self, key, start, path):
        elapsed = time.perf_counter() - start
        self.dist.barrier()
        self.figures.update({f"{key}_s": elapsed, f"{key}_peak": self.peak()})
        if key == "save":
            self.figures["written"] = harness.dir_bytes(path) / _MIB


def _data(cfg, batch, steps):
    import numpy as np

    rng, n = np.random.default_rng(0), batch * steps
    if cfg["kind"] == "embed":
        x = rng.integers(0, cfg["vocab"], size=(n, cfg["seq"]), dtype="int64")
        return x, rng.standard_normal((n, cfg["units"]), dtype="float32")
    if cfg["kind"] == "transformer":
        shape = (n, cfg["seq"], cfg["d_model"])
    else:
        shape = (n, cfg["width"])
    return (rng.standard_normal(shape, dtype="float32") for _ in "xy")


# ------------------------------------------------------------------ torch
def _torch_model(cfg):
    import torch

    if cfg["kind"] == "transformer":
        return bench_step._torch_transformer(cfg)
    if cfg["kind"] == "fsdp":  # bench_step.py's MLP, wider
        return bench_step._torch_mlp(cfg)

    class EmbedMean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(cfg["vocab"], cfg["dim"])
            self.dense = torch.nn.Linear(cfg["dim"], cfg["units"])

        def forward(self, x):
            return self.dense(self.embedding(x).mean(dim=1))

    return EmbedMean()


def _torch_build(cfg, mesh):
    """The model (`mesh=None`: plain torch, one process) and its Adam."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel as Col
    from torch.distributed.tensor.parallel import RowwiseParallel as Row
    from torch.distributed.tensor.parallel import parallelize_module

    with torch.device("meta"):
        model = _torch_model(cfg)
    if mesh is not None and cfg["kind"] == "fsdp":
        for module in model:
            if isinstance(module, torch.nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mesh is not None and cfg["kind"] == "transformer":
        plan = bench_step._tp_plan("transformer", model)
        model = parallelize_module(model, mesh, plan)
    elif mesh is not None:
        table = Col(output_layouts=Replicate())
        if cfg.get("vocab_tp"):
            table = Row(input_layouts=Replicate())
        plan = {"embedding": table, "dense": Col(output_layouts=Replicate())}
        model = parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.dim() > 1:
                local.normal_(0.0, 0.02, generator=generator)
            else:  # biases 0, LayerNorm scales 1
                local.fill_(float(name.endswith("weight")))
    return model, bench_step.adam(list(model.parameters()), 1e-3)


def _run_native(cfg, args, workdir):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = None
    if not args.single:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    probe = _Probe()
    probe.start()
    model, optimizer = _torch_build(cfg, mesh)
    probe.figures["build"] = probe.rss()
    x, y = (torch.from_numpy(a) for a in _data(cfg, args.batch, args.steps))
    probe.start()
    share, start = args.batch, 0  # TP: every rank runs the whole batch
    if cfg["kind"] == "fsdp" and mesh is not None:  # FSDP2: its rows
        share = args.batch // dist.get_world_size()
        start = dist.get_rank() * share
    for i in range(args.steps):
        rows = slice(i * args.batch + start, i * args.batch + start + share)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
    del loss  # its graph holds the parameters (AccumulateGrad nodes)
    dist.barrier()
    probe.end_fit()
    params = list(model.parameters())
    slots = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    held = params + [p.grad for p in params] + slots
    probe.figures["state"] = bench_step.local_bytes(held) / _MIB
    if args.no_checkpoint:
        return probe
    path = os.path.join(workdir, "native_ckpt")
    start = probe.start()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    probe.timed("save", start, path)
    del model, optimizer, params, slots, held, model_state, optim_state
    probe.trim()
    probe.start()
    model, optimizer = _torch_build(cfg, mesh)
    start = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    probe.timed("load", start, path)
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    probe.figures["loaded_step"] = int(max(steps)) if steps else None
    return probe


# ------------------------------------------------------------------ keras
def _keras_model(keras, cfg):
    if cfg["kind"] == "fsdp":
        return bench_step._keras_model(keras, "mlp", cfg)
    if cfg["kind"] == "transformer":
        return bench_step._keras_model(keras, "transformer", cfg)
    inputs = keras.Input((cfg["seq"],), dtype="int64")
    table = keras.layers.Embedding(cfg["vocab"], cfg["dim"], name="embedding")
    h = keras.layers.GlobalAveragePooling1D()(table(inputs))
    outputs = keras.layers.Dense(cfg["units"], name="dense")(h)
    return keras.Model(inputs, outputs)


def _distribute(keras, cfg):
    """Sets ModelParallel; the probe, with `plan`'s prediction (taken on
    meta before the baseline)."""
    import keras_dtensor

    keras.distribution.initialize()
    shape = None
    if cfg["kind"] == "fsdp":  # weights and batch over the same axis
        shape = (keras.distribution.get_device_count(),)
        layouts = {"dense_.*/kernel": ("batch", None)}
    elif cfg["kind"] == "transformer":
        layouts = bench_step._keras_layouts("transformer", "kd_mp")
    else:
        table = ("model", None) if cfg.get("vocab_tp") else (None, "model")
        layouts = {"embedding/embeddings": table}
        layouts["dense/kernel"] = (None, "model")
    distribution = harness.model_parallel(keras, layouts, shape)
    predicted = keras_dtensor.plan(
        lambda: _keras_model(keras, cfg), distribution, optimizer="adam"
    )
    probe = _Probe()
    probe.figures["plan"] = predicted.total_bytes_per_rank / _MIB
    return probe


def _run_kd(cfg, args, workdir):
    if args.single:  # the reference: plain Keras, one process
        import torch.distributed as dist

        dist.init_process_group("gloo")  # for the probe's barriers only
        import keras

        probe = _Probe()
    else:
        import keras_dtensor  # noqa: F401, I001
        import keras

        probe = _distribute(keras, cfg)

    def build():
        keras.utils.set_random_seed(0)
        model = _keras_model(keras, cfg)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        return model

    probe.start()
    model = build()
    probe.figures["build"] = probe.rss()
    x, y = _data(cfg, args.batch, args.steps)
    probe.start()
    model.fit(x, y, batch_size=args.batch, shuffle=False, verbose=0)
    probe.end_fit()
    weights = [v.value for v in model.trainable_weights]
    slots = [v.value for v in model.optimizer.variables if len(v.shape)]
    held = weights + [w.grad for w in weights] + slots
    probe.figures["state"] = bench_step.local_bytes(held) / _MIB
    del weights, slots, held
    if args.no_checkpoint:
        return probe
    path = os.path.join(workdir, "kd.weights.h5")
    start = probe.start()
    model.save_weights(path)
    probe.timed("save", start, path)
    del model  # not clear_session(): it would drop the distribution
    probe.trim()
    probe.start()
    model = build()
    # Slots to load into, as torch's get_state_dict makes for DCP.
    model.optimizer.build(model.trainable_variables)
    start = time.perf_counter()
    model.load_weights(path)
    probe.timed("load", start, path)
    probe.figures["loaded_step"] = int(model.optimizer.iterations.numpy())
    return probe


# ----------------------------------------------------------------- driver
def worker(args):
    import torch.distributed as dist

    harness.start_worker()
    run = _run_native if args.side == "native" else _run_kd
    probe = run(MODELS[args.model], args, args.workdir)
    harness.write_result(args.result_dir, probe.figures)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = harness.parser(__doc__, out=False, nproc=4)
    parser.add_argument("--models", default="a,b,c")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--mmap-threshold", type=int, default=0)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--single", action="store_true", help="(worker)")
    parser.add_argument("--side", choices=SIDES, help="(worker)")
    parser.add_argument("--model", choices=sorted(MODELS), help="(worker)")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    env = {}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    flags = [f"--batch={args.batch}", f"--steps={args.steps}"]
    flags += ["--no-checkpoint"] * args.no_checkpoint
    summary = {"results": {}, "reference": {}, "nproc": args.nproc}
    summary.update(batch=args.batch, steps=args.steps, env=env)
    for model in args.models.split(","):
        for side, single in itertools.product(
            SIDES, (False, True)[: 1 + args.reference]
        ):
            key, nproc = ("reference", 1) if single else ("results", args.nproc)
            flag = [f"--side={side}", f"--model={model}", *flags]
            with tempfile.TemporaryDirectory() as workdir:
                flag += [f"--workdir={workdir}"] + ["--single"] * single
                ranks = harness.launch(__file__, nproc, flag, env)
            summary[key].setdefault(model, {})[side] = ranks
    harness.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
