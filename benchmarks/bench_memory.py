"""Per-rank memory of training and checkpointing: keras-dtensor against torch.

    python benchmarks/bench_memory.py                 # models a, b, c; 4 ranks
    python benchmarks/bench_memory.py --models a --json out.json
    python benchmarks/bench_memory.py --models c --reference  # + one process

Each side of each model runs in a fresh `torch.distributed.run` group of
`--nproc` processes (one thread each) launched by this script, so neither
side's allocations, caches or malloc arenas reach the other's figures.

Models (fp32, Adam, MSE on random targets, batch `--batch`):

- a: Embedding(1_000_000, 128) sharded on its hidden axis (None, "model"),
  mean over a sequence of 4 tokens, Dense(256) with its kernel
  (None, "model"). torch: `nn.Embedding` and `nn.Linear` under
  `ColwiseParallel` (outputs replicated).
- b: the same with the vocabulary-parallel embedding ("model", None).
  torch: `RowwiseParallel` on the `nn.Embedding` (indices replicated).
- c: bench_step.py's transformer blocks and TP split (q/k/v and MLP-up
  column-parallel, attention output and MLP-down row-parallel), wider so
  that the weights stand out of the process's noise.
- d: FSDP-style: 8 Dense(2048) layers (ReLU between), every kernel
  sharded on its first dim over the batch axis (`("batch", None)`), the
  batch sharded too; 128 MiB of weights. torch: FSDP2, `fully_shard` on
  each `nn.Linear` and on the root (so each layer's weights are gathered
  for its forward, freed after it, gathered again for its backward).

torch side: the model is built on the meta device, `parallelize_module`
lays it out, `to_empty` materializes the shards only, `torch.optim.Adam`
(foreach) trains it; `torch.distributed.checkpoint` saves and loads model
and optimizer state (`get_state_dict` / `set_state_dict`). keras-dtensor
side: the Keras model under `ModelParallel` with a `LayoutMap` (sharded
variables created shard-only), `fit`, `save_weights` to `.weights.h5` and
`load_weights` into a fresh sharded model whose optimizer is built (a
compiled model's `.weights.h5` holds the optimizer's variables too: both
sides write weights and Adam's slots; the bytes written and the optimizer
step found after the load are reported).

`--reference` also runs each side as one plain process (torch without
`parallelize_module`, Keras without a distribution or keras-dtensor) on
the same model and batch: how much memory Keras's own step takes over
torch's, the reference for keras-dtensor over TP (as the step-time
targets divide by Keras single over torch single).

Per rank, from `/proc/self/status`, in MiB above a baseline taken after
imports and the process group's start:

- build: RSS once the model (and torch's optimizer) exist;
- fit peak: VmHWM over the training steps (the peak is reset before the
  phase by writing "5" to `/proc/self/clear_refs`);
- steady: VmRSS after the steps (the torch loop still holds the last
  step's gradients, freed at the start of the next step as usual;
  keras-dtensor drops them once applied); "steady trimmed": the same after
  `malloc_trim(0)`, and "malloc free": bytes glibc's arenas hold free
  (`mallinfo2().fordblks`) before the trim. RSS counts memory glibc
  keeps after `free` (arenas, the heap top below the trim threshold);
  tensors over the mmap threshold (dynamic, at most 32 MiB) go back to the
  OS when freed, smaller ones may not, so RSS can overstate live tensors;
  the two extra columns show by how much;
- save / load: wall time (slowest rank) and peak RSS above the baseline.
  Before the load, the trained model and optimizer are dropped and a fresh
  one is built; its build is inside the load peak, not its time.

Also per rank: "state", the bytes of the local parameter shards, the
gradients still held after the steps and Adam's two slots, which the steady
figure should approach.
"""

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_MIB = 2**20
MODELS = {
    "a": dict(kind="embed", vocab=1_000_000, dim=128, seq=4, units=256),
    "b": dict(
        kind="embed", vocab=1_000_000, dim=128, seq=4, units=256, vocab_tp=1
    ),
    "c": dict(
        kind="transformer", d_model=1024, heads=8, mlp=4096, seq=32, blocks=2
    ),
    "d": dict(kind="fsdp", width=2048, layers=8),
}
SIDES = ("native", "kd")
# (key, label) of the per-rank figures, MiB unless noted.
METRICS = (
    ("build", "build RSS"),
    ("fit_peak", "fit peak"),
    ("steady", "steady after fit"),
    ("steady_trimmed", "steady, malloc_trim"),
    ("malloc_free", "malloc free (arenas)"),
    ("state", "state: params + held grads + 2 slots"),
    ("plan", "plan: params + 2 slots, predicted on meta"),
    ("save_peak", "save peak"),
    ("save_s", "save s"),
    ("load_start", "before load (trained model dropped)"),
    ("load_peak", "load peak"),
    ("load_s", "load s"),
    ("written", "MiB written"),
    ("loaded_step", "optimizer step after load"),
)


# ------------------------------------------------------------ measurement
def _status():
    """VmRSS and VmHWM of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def _reset_peak():
    """Resets VmHWM to the current RSS (Linux `clear_refs`, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Libc:
    """glibc's `mallinfo2` and `malloc_trim`, when available."""

    class _Info(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    def __init__(self):
        try:
            self._libc = ctypes.CDLL("libc.so.6")
            self._libc.mallinfo2.restype = self._Info
        except (OSError, AttributeError):
            self._libc = None

    def free_bytes(self):
        return None if self._libc is None else self._libc.mallinfo2().fordblks

    def trim(self):
        if self._libc is not None:
            self._libc.malloc_trim(0)


class _Probe:
    """Per-rank figures, relative to the baseline taken at construction."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.libc = _Libc()
        gc.collect()
        dist.barrier()
        self.base = _status()["VmRSS"]
        self.figures = {"baseline_rss": self.base / _MIB}

    def start(self):
        gc.collect()
        self.dist.barrier()
        _reset_peak()
        return time.perf_counter()

    def rss(self):
        return (_status()["VmRSS"] - self.base) / _MIB

    def peak(self):
        return (_status()["VmHWM"] - self.base) / _MIB

    def end_fit(self):
        self.figures["fit_peak"] = self.peak()
        self.figures["steady"] = self.rss()
        gc.collect()
        free = self.libc.free_bytes()
        self.figures["malloc_free"] = None if free is None else free / _MIB
        self.libc.trim()
        self.figures["steady_trimmed"] = self.rss()

    def timed(self, key, start):
        elapsed = time.perf_counter() - start
        self.dist.barrier()
        self.figures[f"{key}_s"] = elapsed
        self.figures[f"{key}_peak"] = self.peak()


def _local_bytes(tensors):
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _dir_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def _data(cfg, batch, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    n = batch * steps
    if cfg["kind"] == "embed":
        x = rng.integers(0, cfg["vocab"], size=(n, cfg["seq"]), dtype="int64")
        y = rng.standard_normal((n, cfg["units"]), dtype="float32")
    elif cfg["kind"] == "fsdp":
        x = rng.standard_normal((n, cfg["width"]), dtype="float32")
        y = rng.standard_normal((n, cfg["width"]), dtype="float32")
    else:
        shape = (n, cfg["seq"], cfg["d_model"])
        x = rng.standard_normal(shape, dtype="float32")
        y = rng.standard_normal(shape, dtype="float32")
    return x, y


# ------------------------------------------------------------------ torch
def _bench_step():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_step

    return bench_step


def _torch_model(cfg):
    import torch

    if cfg["kind"] == "transformer":
        return _bench_step()._torch_transformer(
            dict(cfg, d_model=cfg["d_model"], heads=cfg["heads"])
        )
    if cfg["kind"] == "fsdp":  # bench_step.py's MLP, wider
        return _bench_step()._torch_mlp(cfg)

    class EmbedMean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(cfg["vocab"], cfg["dim"])
            self.dense = torch.nn.Linear(cfg["dim"], cfg["units"])

        def forward(self, x):
            return self.dense(self.embedding(x).mean(dim=1))

    return EmbedMean()


def _torch_plan(cfg, model):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    if cfg["kind"] == "transformer":
        return _bench_step()._tp_plan("transformer", model)
    if cfg.get("vocab_tp"):
        embedding = RowwiseParallel(input_layouts=Replicate())
    else:
        embedding = ColwiseParallel(output_layouts=Replicate())
    return {
        "embedding": embedding,
        "dense": ColwiseParallel(output_layouts=Replicate()),
    }


def _torch_build(cfg, mesh):
    """The model (`mesh=None`: plain torch, one process) and its Adam."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    with torch.device("meta"):
        model = _torch_model(cfg)
    if mesh is not None and cfg["kind"] == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in model:
            if isinstance(module, torch.nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mesh is not None:
        model = parallelize_module(model, mesh, _torch_plan(cfg, model))
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.dim() > 1:
                local.normal_(0.0, 0.02, generator=generator)
            else:  # biases 0, LayerNorm scales 1
                local.fill_(float(name.endswith("weight")))
    params = list(model.parameters())
    # TP leaves LayerNorm parameters plain: one foreach group per kind.
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.Adam(groups, lr=1e-3, foreach=True)
    return model, optimizer


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
        first = i * args.batch + start
        rows = slice(first, first + share)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
    # The last loss's graph holds the parameters (AccumulateGrad nodes).
    del loss
    dist.barrier()
    probe.end_fit()
    params = list(model.parameters())
    slots = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    probe.figures["state"] = (
        _local_bytes(params + [p.grad for p in params] + slots) / _MIB
    )

    if args.no_checkpoint:
        return probe
    path = os.path.join(workdir, "native_ckpt")
    start = probe.start()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    probe.timed("save", start)
    probe.figures["written"] = _dir_bytes(path) / _MIB

    del model, optimizer, params, slots, model_state, optim_state
    probe.libc.trim()
    probe.start()
    probe.figures["load_start"] = probe.rss()
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
    probe.timed("load", start)
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    probe.figures["loaded_step"] = int(max(steps)) if steps else None
    return probe


# ------------------------------------------------------------------ keras
def _keras_layouts(cfg):
    if cfg["kind"] == "fsdp":
        return {"dense_.*/kernel": ("batch", None)}
    if cfg["kind"] == "transformer":
        return _bench_step()._keras_layouts("transformer", "kd_mp")
    table = ("model", None) if cfg.get("vocab_tp") else (None, "model")
    return {"embedding/embeddings": table, "dense/kernel": (None, "model")}


def _keras_model(keras, cfg):
    if cfg["kind"] == "fsdp":
        return _bench_step()._keras_model(keras, "mlp", cfg)
    if cfg["kind"] == "transformer":
        return _bench_step()._keras_model(keras, "transformer", cfg)
    inputs = keras.Input((cfg["seq"],), dtype="int64")
    h = keras.layers.Embedding(cfg["vocab"], cfg["dim"], name="embedding")(
        inputs
    )
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(cfg["units"], name="dense")(h)
    return keras.Model(inputs, outputs)


def _run_kd(cfg, args, workdir):
    if args.single:  # the reference: plain Keras, one process
        import torch.distributed as dist

        dist.init_process_group("gloo")  # for the probe's barriers only
        import keras

        probe = _Probe()
    else:
        probe = _plan_kd(cfg)
        import keras

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
    probe.figures["state"] = (
        _local_bytes(weights + [w.grad for w in weights] + slots) / _MIB
    )
    del weights, slots

    if args.no_checkpoint:
        return probe
    path = os.path.join(workdir, "kd.weights.h5")
    start = probe.start()
    model.save_weights(path)
    probe.timed("save", start)
    probe.figures["written"] = _dir_bytes(path) / _MIB

    # (Not keras.backend.clear_session(): it would drop the distribution.)
    del model
    probe.libc.trim()
    probe.start()
    probe.figures["load_start"] = probe.rss()
    model = build()
    # Slots to load into, as torch's get_state_dict makes for DCP: Keras
    # skips a saved optimizer state that an unbuilt optimizer cannot take.
    model.optimizer.build(model.trainable_variables)
    start = time.perf_counter()
    model.load_weights(path)
    probe.timed("load", start)
    probe.figures["loaded_step"] = int(model.optimizer.iterations.numpy())
    return probe


def _plan_kd(cfg):
    """Sets the ModelParallel distribution; the probe, with the plan's
    prediction."""
    import keras_dtensor  # noqa: F401, I001
    import keras

    keras.distribution.initialize()
    world = keras.distribution.get_device_count()
    if cfg["kind"] == "fsdp":  # weights and batch over the same axis
        mesh = keras.distribution.DeviceMesh((world,), ["batch"])
    else:
        mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in _keras_layouts(cfg).items():
        layout_map[key] = axes
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    keras.distribution.set_distribution(distribution)
    # The prediction first, on `meta`, before the baseline (issue 13,
    # item 4: within 10% of the steady memory measured below).
    predicted = keras_dtensor.plan(
        lambda: _keras_model(keras, cfg), distribution, optimizer="adam"
    )
    probe = _Probe()
    probe.figures["plan"] = predicted.total_bytes_per_rank / _MIB
    return probe


# ----------------------------------------------------------------- driver
def worker(args):
    # A torch-only environment: Keras's set_random_seed imports TensorFlow
    # whenever it is installed, which costs every process ~400 MB.
    sys.modules.setdefault("tensorflow", None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = MODELS[args.model]
    run = _run_native if args.side == "native" else _run_kd
    probe = run(cfg, args, args.workdir)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(probe.figures, gathered, dst=0)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _launch(side, model, args, single=False):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        **(
            {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
            if args.mmap_threshold
            else {}
        ),
        KERAS_BACKEND="torch",
        KERAS_DTENSOR_LOG_ALL_RANKS="0",
        CUDA_VISIBLE_DEVICES="",
    )
    workdir = tempfile.mkdtemp(prefix="bench_memory_")
    result = os.path.join(workdir, "result.json")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={1 if single else args.nproc}",
        os.path.abspath(__file__),
        "worker",
        f"--side={side}",
        f"--model={model}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--workdir={workdir}",
        f"--result={result}",
    ]
    if args.no_checkpoint:
        command.append("--no-checkpoint")
    if single:
        command.append("--single")
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not os.path.exists(result):
            raise RuntimeError(f"{side}/{model} failed:\n{proc.stderr[-4000:]}")
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _worst(ranks, key):
    values = [r.get(key) for r in ranks]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _fmt(value, key):
    if value is None:
        return "-"
    return f"{value:.2f}" if key.endswith("_s") else f"{value:.0f}"


def _markdown(summary):
    lines = [
        "| model | figure (per rank, MiB above baseline) | torch TP | "
        "keras-dtensor | kd / torch |",
        "|---|---|---|---|---|",
    ]
    for model, sides in summary["results"].items():
        for key, label in METRICS:
            native = _worst(sides["native"], key)
            kd = _worst(sides["kd"], key)
            if native is None and kd is None:
                continue  # not measured (--no-checkpoint)
            ratio = (
                f"{kd / native:.2f}"
                if native and kd is not None and native > 0
                else "-"
            )
            lines.append(
                f"| {model} | {label} | {_fmt(native, key)} | "
                f"{_fmt(kd, key)} | {ratio} |"
            )
        planned = _worst(sides["kd"], "plan")
        for key in ("steady", "steady_trimmed"):
            measured = _worst(sides["kd"], key)
            if planned and measured is not None:
                lines.append(
                    f"| {model} | kd {key.replace('_', ' ')} / plan | - | "
                    f"{measured / planned:.2f} | - |"
                )
    if summary.get("reference"):
        lines += [
            "",
            "The reference: plain torch and plain Keras, one process, the "
            "same model, optimizer and batch (no distribution):",
            "",
            "| model | figure (MiB above baseline) | torch single | "
            "Keras single | Keras / torch | kd / TP (above) |",
            "|---|---|---|---|---|---|",
        ]
        for model, single in summary["reference"].items():
            sides = summary["results"][model]
            for key in ("fit_peak", "steady", "steady_trimmed"):
                t, k = single["native"][0][key], single["kd"][0][key]
                native = _worst(sides["native"], key)
                kd = _worst(sides["kd"], key)
                lines.append(
                    f"| {model} | {dict(METRICS)[key]} | {t:.0f} | {k:.0f} | "
                    f"{k / t:.2f} | {kd / native:.2f} |"
                )
    lines.append("")
    lines.append(
        "Worst rank of each figure. Baseline RSS (after imports and the "
        "process group): "
        + ", ".join(
            f"{m} {s}: {_worst(v[s], 'baseline_rss'):.0f} MiB"
            for m, v in summary["results"].items()
            for s in SIDES
        )
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "mode", nargs="?", default="bench", choices=["bench", "worker"]
    )
    parser.add_argument("--models", default="a,b,c")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="training figures only"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="MALLOC_MMAP_THRESHOLD_ for every worker (bytes; 0: glibc's "
        "dynamic default). A fixed threshold gives every allocation above "
        "it back to the OS when freed, so RSS follows live tensors.",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also run plain torch and plain Keras in one process (no "
        "distribution): Keras's own memory over torch's, the reference "
        "for kd over TP",
    )
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), help="(worker)")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        return worker(args)

    started = time.time()
    results, reference = {}, {}
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {list(MODELS)}")
        results[model] = {}
        for side in args.sides.split(","):
            results[model][side] = _launch(side, model, args)
            print(f"{model} {side}: done", file=sys.stderr, flush=True)
            if args.reference:
                reference.setdefault(model, {})[side] = _launch(
                    side, model, args, single=True
                )
                print(f"{model} {side} single: done", file=sys.stderr)
    summary = {
        "results": results,
        "reference": reference,
        "models": {m: MODELS[m] for m in results},
        "nproc": args.nproc,
        "batch": args.batch,
        "steps": args.steps,
        "mmap_threshold": args.mmap_threshold,
        "seconds": time.time() - started,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if set(args.sides.split(",")) == set(SIDES):
        print(_markdown(summary))
    else:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
