"""`keras-dtensor` command line: `info`, `demo`, `run` and `plan`
(docs/guides/launching.md; `keras-dtensor <command> --help`)."""

import argparse
import os
import sys

__all__ = ["main"]


def _info(args):
    import platform

    import keras
    import torch
    import torch.distributed as dist

    import keras_dtensor
    from keras_dtensor import compat
    from keras_dtensor import config
    from keras_dtensor import patches
    from keras_dtensor.backend import launch
    from keras_dtensor.backend import object_state

    launched = dist.is_initialized() or launch.under_launcher()
    for label, value in (
        ("keras-dtensor", keras_dtensor.__version__),
        ("keras", f"{keras.__version__} (supported {compat.SUPPORTED_KERAS})"),
        ("torch", f"{torch.__version__} (supported {compat.SUPPORTED_TORCH})"),
        ("keras_hub", compat.keras_hub_version() or "not installed"),
        ("python", platform.python_version()),
        ("backend", keras.backend.backend()),
        ("device", launch.local_device()),
        (
            "world",
            f"rank {launch.process_id()} of {launch.num_processes()}"
            + ("" if launched else " (no launcher)"),
        ),
        ("devices", keras.distribution.list_devices()),
        (
            "keras's own",
            "torch distribution: shipped "
            "(keras.src.backend.torch.distribution_lib); the entries below "
            "marked keras>=3.16 stand it down"
            if compat.keras_ships_torch_distribution()
            else "torch distribution: none (Keras 3.15 has no torch "
            "distribution)",
        ),
    ):
        print(f"{label:13} {value}")
    status = patches.status()
    applied = sum(state == "applied" for _, state, _ in status)
    skipped = sum(state.startswith("skipped") for _, state, _ in status)
    print(
        f"\nhooks into Keras and torch (keras_dtensor.patches): {applied} "
        f"applied, {skipped} skipped on these versions, {len(status)} entries"
    )
    for target, state, why in status:
        print(f"  [{state}] {target}\n      {why}")
    attached = object_state.status()
    print(
        "\nattributes set on single objects (undone by uninstall()): "
        + (", ".join(f"{t}.{n}" for t, n in attached) or "none")
    )
    print("\nenvironment (src/keras_dtensor/config.py):")
    for env, raw, default, what in config.settings():
        value = "unset" if raw is None else repr(raw)
        print(f"  {env}={value} (default {default!r})\n      {what}")
    return 0


def _demo(args):
    args.module, args.script, args.max_restarts = True, "keras_dtensor.demo", 0
    args.script_args = [f"--epochs={args.epochs}"]
    # Whatever the shell says: the demo is a torch job, one thread a rank.
    os.environ.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    return _run(args)


def _run(args):
    """torch's elastic launcher on one machine: a free loopback port, one
    OpenMP thread per rank unless set."""
    import torch.distributed.run as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("KERAS_BACKEND", "torch")
    launcher_args = [
        "--nnodes=1",
        f"--nproc-per-node={args.nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={args.max_restarts}",
        *(["-m"] if args.module else []),
        args.script,
        *args.script_args,
    ]
    try:
        torchrun.run(torchrun.parse_args(launcher_args))
    except Exception as e:  # ChildFailedError: torch printed the details
        print(f"keras-dtensor run: {e.__class__.__name__}", file=sys.stderr)
        return 1
    return 0


def _plan(args):
    """Bytes per rank of a layout, nothing allocated."""
    import functools
    import json
    import pkgutil

    import keras
    import numpy as np

    import keras_dtensor

    shape = tuple(int(n) for n in args.mesh.split(","))
    names = args.axis_names.split(",")
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    mesh = keras.distribution.DeviceMesh(shape, names, devices)
    config = json.loads(args.config) if args.config else {}
    if args.keras_hub:
        import keras_hub

        build_fn = getattr(keras_hub.models, args.keras_hub)
        if not args.auto_layout:
            layout_map = build_fn.get_layout_map(mesh)
    else:
        build_fn = pkgutil.resolve_name(args.auto or args.model)
        if args.model:
            layout_map = pkgutil.resolve_name(args.layout_map)(mesh)
    build = functools.partial(build_fn, **config)
    if args.auto or args.auto_layout:
        auto = keras_dtensor.auto_layout(build, mesh)
        print(auto)
        layout_map = auto.layout_map
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    print(keras_dtensor.plan(build, distribution, optimizer=args.optimizer))
    return 0


def main(argv=None):
    """Entry point of the `keras-dtensor` script."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    parser = argparse.ArgumentParser(
        prog="keras-dtensor",
        description="Keras distribution API on torch DTensor.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser(
        "info", help="versions, world/rank view, hook table status"
    )
    info.set_defaults(run=_info)
    demo = commands.add_parser(
        "demo",
        help="train a small transformer with ModelParallel on CPU processes",
    )
    demo.add_argument("--nproc", type=int, default=2)
    demo.add_argument("--epochs", type=int, default=3)
    demo.set_defaults(run=_demo)
    plan = commands.add_parser(
        "plan",
        help="per-rank bytes of a ModelParallel layout, built on meta",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--keras-hub", help="a keras_hub backbone class, e.g. GemmaBackbone"
    )
    source.add_argument("--model", help="module:function building the model")
    source.add_argument(
        "--auto",
        help="module:function building the model; its layout derived by "
        "keras_dtensor.auto_layout (each weight's layout and why)",
    )
    plan.add_argument(
        "--auto-layout",
        action="store_true",
        help="with --keras-hub: the derived layout, not keras_hub's map",
    )
    plan.add_argument(
        "--layout-map", help="module:function(mesh) -> LayoutMap (--model)"
    )
    plan.add_argument("--config", help="JSON keyword arguments of the model")
    plan.add_argument("--mesh", default="1,8", help="mesh shape, e.g. 2,4")
    plan.add_argument("--axis-names", default="batch,model")
    plan.add_argument("--optimizer", default="adamw")
    plan.set_defaults(run=_plan)
    run = commands.add_parser(
        "run",
        help="run a script on N local processes (torch's elastic launcher)",
    )
    run.add_argument("-n", "--nproc", type=int, required=True)
    run.add_argument("--max-restarts", type=int, default=0)
    run.add_argument("-m", "--module", action="store_true")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(run=_run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
