"""Process-group lifecycle (one device per process; torchrun's or Keras's
rendezvous, else a group of one in memory) and small collectives."""

import atexit
import datetime
import os
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from keras_dtensor import compat
from keras_dtensor import config
from keras_dtensor.backend import placement_order

__all__ = [
    "all_gather_bytes",
    "all_gather_int_lists",
    "all_gather_ints",
    "broadcast_bytes",
    "device_type",
    "init_process_group",
    "local_device",
    "agree_on_seed",
    "every_rank_joins",
    "multi_process",
    "process_id",
    "num_processes",
    "under_launcher",
    "world",
]


def under_launcher() -> bool:
    """Whether `RANK`, `WORLD_SIZE` and a rendezvous address are set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE")) and (
        "MASTER_ADDR" in os.environ or config.get("INIT_METHOD") is not None
    )


def device_type() -> str:
    """`"cuda"` when this process computes on a GPU, else `"cpu"`."""
    device = compat.torch_core().get_device()
    return "cuda" if str(device).startswith("cuda") else "cpu"


def local_device() -> torch.device:
    """This process's own device: `cuda:LOCAL_RANK` on GPUs, else `cpu`."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_process_group(job_addresses=None, num_processes=None, process_id=None):
    """Starts the default process group once (`True` if this call did)."""
    if dist.is_initialized():
        world = dist.get_world_size()
        if num_processes is not None and num_processes != world:
            raise ValueError(
                "The process group is already running with "
                f"{world} processes. Received: num_processes={num_processes}"
            )
        return False
    timeout = datetime.timedelta(seconds=config.get("TIMEOUT"))
    url, kwargs = None, {}
    if job_addresses:
        addresses = job_addresses.split(",")
        if num_processes not in (None, len(addresses)) and len(addresses) > 1:
            raise ValueError(
                f"The provided job_addresses {addresses} has "
                f"{len(addresses)} jobs, but num_processes is "
                f"{num_processes}"
            )
        if process_id is None:
            raise ValueError(
                "`process_id` is required with `job_addresses`. Received: "
                f"job_addresses={job_addresses}, process_id=None"
            )
        url = f"tcp://{addresses[0]}"
        world = len(addresses) if num_processes is None else num_processes
        kwargs = dict(rank=process_id, world_size=world)
    elif under_launcher():
        url = config.get("INIT_METHOD") or "env://"
        if url != "env://":
            rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
            kwargs = dict(rank=int(rank), world_size=int(world))
    store, rank, world = dist.HashStore(), 0, 1
    if url is not None:
        rendezvous = dist.rendezvous(url, timeout=timeout, **kwargs)
        store, rank, world = next(rendezvous)
    # A fresh key space per torchrun restart.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"keras_dtensor/{restart}", store)
    backend = config.get("BACKEND")
    if device_type() == "cuda":
        torch.cuda.set_device(local_device())
        backend = backend or "cpu:gloo,cuda:nccl"
    backend = backend or "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout
    )
    atexit.register(_destroy)
    digests = all_gather_ints(placement_order.order_digest())
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(
            "keras_dtensor: ranks order DTensor placements differently "
            f"(ranks {odd} differ from rank 0 of {len(digests)}), so they "
            "may choose different sharding strategies and hang. Import "
            "keras_dtensor on every rank before the first DTensor op, and "
            "do not call keras_dtensor.uninstall() on some ranks only."
        )
    agree_on_seed()
    return True


def agree_on_seed():
    """Rank 0's Keras seed on every rank, unless one was set."""
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    if rng_utils.get_random_seed() is not None:
        return
    default = seed_generator.make_default_seed()
    seed = torch.tensor([default], dtype=torch.int64, device=local_device())
    if multi_process():
        dist.broadcast(seed, src=0)
    rng_utils.set_random_seed(int(seed.item()))


def world() -> tuple[int, int]:
    """`(world size, rank)` of the running group, else `(1, 0)`."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def all_gather_ints(value: int) -> list[int]:
    """Every rank's `value`, in rank order (a collective)."""
    return [row[0] for row in all_gather_int_lists([value])]


def all_gather_int_lists(values: list[int]) -> list[list[int]]:
    """Every rank's list of ints (the same length on every rank), by rank."""
    size, _ = world()
    if size == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine)
    return [g.tolist() for g in gathered]


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """`src`'s `data` on every rank (a collective; as uint8 tensors)."""
    size, rank = world()
    if size == 1:
        return data
    length = torch.tensor([len(data) if rank == src else 0])
    dist.broadcast(length, src=src)
    if rank == src:  # a copy: `frombuffer` shares the bytes' memory
        buffer = torch.from_numpy(np.frombuffer(data, np.uint8).copy())
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    if buffer.numel():
        dist.broadcast(buffer, src=src)
    return data if rank == src else buffer.numpy().tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order (a collective; as uint8 tensors)."""
    size, _ = world()
    if size == 1:
        return [data]
    lengths = all_gather_ints(len(data))
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded.numpy()[: len(data)] = np.frombuffer(data, np.uint8)
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded)
    return [
        g[:n].numpy().tobytes() for g, n in zip(gathered, lengths, strict=True)
    ]


def multi_process() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_initialized() and dist.get_world_size() > 1


def _started() -> bool:
    if not dist.is_initialized() and under_launcher():
        init_process_group()
    return dist.is_initialized()


def num_processes() -> int:
    """World size; starts the group lazily under torchrun."""
    return dist.get_world_size() if _started() else 1


def process_id() -> int:
    """Global rank; starts the group lazily under torchrun."""
    return dist.get_rank() if _started() else 0


def _destroy():
    # Hands the GIL to gloo workers still queued for it before Python
    # finalizes (else SIGABRT at exit); see docs/internals/backend.md.
    time.sleep(0.05)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # teardown must not mask the real exit
            warnings.warn(
                f"keras_dtensor: process group teardown: {e}", stacklevel=1
            )


def every_rank_joins(what: str, why: str) -> None:
    """Raises if some rank does not join `what` in time (in the store, which
    no collective can pair with)."""
    if not multi_process():
        return
    timeout = config.get("SAVE_TIMEOUT")
    size, rank = dist.get_world_size(), dist.get_rank()
    start = time.monotonic()
    try:
        store = dist.distributed_c10d._get_default_store()
        # The n-th join of every rank meets at key n.
        prefix = "keras_dtensor/joins"
        call = store.add(f"{prefix}/rank{rank}", 1)
        key = f"{prefix}/{call}"
        if store.check([f"{key}/abandoned"]):
            raise RuntimeError(
                f"rank {store.get(f'{key}/abandoned').decode()} gave up "
                "waiting at this call earlier"
            )
        if store.add(key, 1) == size:
            store.set(f"{key}/all", b"1")
        try:
            store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout))
        except RuntimeError:
            store.set(f"{key}/abandoned", str(rank).encode())
            counts = [store.add(f"{prefix}/rank{r}", 0) for r in range(size)]
            absent = [r for r, n in enumerate(counts) if n < call]
            raise RuntimeError(
                f"{store.add(key, 0)} of {size} ranks arrived; missing: "
                f"rank {', '.join(map(str, absent))}"
            ) from None
    except RuntimeError as e:
        waited = time.monotonic() - start
        raise RuntimeError(
            f"{what} must be called on every rank: {why}. Rank {rank} of "
            f"{size} waited {waited:.1f} s of {timeout:g} s "
            "(KERAS_DTENSOR_SAVE_TIMEOUT) for the others, which did not "
            f"arrive or died. Details: {e}"
        ) from None
