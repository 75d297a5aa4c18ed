"""A map-style DataLoader loads only each process's shard of a global batch,
and a `PyDataset` builds 1/N of the batches per process.

Every rank trains plain one-process Keras and the distributed model on
the same loader, in the same process: history, evaluate, predict and
weights must agree to 1e-5, for every kind of sampler, with an uneven
last batch and with a global batch smaller than the ranks (a rank with no
rows). Each rank must also have fetched only its shard: the samples its
dataset read during `fit` are counted and compared with the split, worked
out here independently of the package.
"""

import contextlib
import threading

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
ROWS = 60
EPOCHS = 2
# A user's batch sampler: uneven batches, one of a single row.
CUSTOM_BATCHES = [
    list(range(0, 7)),
    [7],
    list(range(8, 30)),
    list(range(30, 60)),
]


def _arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 16)).astype("float32")
    y = rng.normal(size=(ROWS, 4)).astype("float32")
    return x, y


class _Counted:
    """A map-style dataset that counts the samples it reads."""

    def __init__(self):
        self.x, self.y = _arrays()
        self.reads = 0

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], self.y[i]


class _Batched(_Counted):
    """Reads a list of indices at once (`__getitems__`), returning the
    arrays whole: its `collate_fn` makes them tensors."""

    def __getitems__(self, indices):
        self.reads += len(indices)
        return self.x[indices], self.y[indices]


def _loader(kind, seed=3):
    import torch
    from torch.utils.data import DataLoader

    generator = torch.Generator().manual_seed(seed)
    if kind == "sequential":
        dataset = _Counted()
        return dataset, DataLoader(dataset, batch_size=8)
    if kind == "shuffled":
        dataset = _Counted()
        return dataset, DataLoader(
            dataset, batch_size=8, shuffle=True, generator=generator
        )
    if kind == "global_rng":  # shuffled from torch's global generator
        dataset = _Counted()
        return dataset, DataLoader(dataset, batch_size=8, shuffle=True)
    if kind == "weighted":
        dataset = _Counted()
        weights = np.linspace(0.1, 1.0, ROWS)
        sampler = torch.utils.data.WeightedRandomSampler(
            weights, ROWS, generator=generator
        )
        return dataset, DataLoader(dataset, batch_size=8, sampler=sampler)
    if kind == "batch_sampler":
        dataset = _Counted()
        return dataset, DataLoader(dataset, batch_sampler=CUSTOM_BATCHES)
    if kind == "getitems":
        dataset = _Batched()

        def collate(pair):
            return tuple(torch.from_numpy(a) for a in pair)

        return dataset, DataLoader(
            dataset, batch_size=8, drop_last=True, collate_fn=collate
        )
    if kind == "workers":  # reads happen in the workers: not counted
        dataset = _Counted()
        return dataset, DataLoader(
            dataset,
            batch_size=8,
            shuffle=True,
            generator=generator,
            num_workers=2,
            persistent_workers=True,
            pin_memory=False,
        )
    if kind.startswith("pydataset"):
        return _py_dataset(kind)
    raise ValueError(kind)


def _py_dataset(kind):
    """A `PyDataset` that counts the rows it builds: batches of 8 (the last
    of 4), or `CUSTOM_BATCHES` as a dict of inputs (a batch of one row)."""
    import keras

    x, y = _arrays()
    bounds = [(i, min(i + 8, ROWS)) for i in range(0, ROWS, 8)]
    if kind == "pydataset_dict":
        bounds = [(b[0], b[-1] + 1) for b in CUSTOM_BATCHES]

    class Rows(keras.utils.PyDataset):
        def __init__(self):
            # Threads build the batches (Keras's enqueuer stands down).
            super().__init__(workers=2 if kind == "pydataset_workers" else 1)
            self.reads = 0
            self.lock = threading.Lock()

        def __len__(self):
            return len(bounds)

        def __getitem__(self, i):
            start, stop = bounds[i]
            with self.lock:
                self.reads += stop - start
            if kind == "pydataset_dict":
                return {"features": x[start:stop]}, y[start:stop]
            return x[start:stop], y[start:stop]

    dataset = Rows()
    return dataset, dataset


def _global_batches(kind):
    """The global batch sizes of one epoch."""
    if kind in ("batch_sampler", "pydataset_dict"):
        return [len(b) for b in CUSTOM_BATCHES]
    if kind == "getitems":
        return [8] * (ROWS // 8)
    return [8] * (ROWS // 8) + [ROWS % 8]


def _split(total, world, rank, torch_chunks):
    """This rank's rows of a global batch of `total`: `np.array_split`'s
    rule (DataParallel) or `torch.chunk`'s (a batch-sharded layout)."""
    if torch_chunks:
        size = -(-total // world)
        return max(0, min(size, total - rank * size))
    return len(np.array_split(np.arange(total), world)[rank])


def _expected_reads(kind, world, index, torch_chunks):
    """Samples a rank at batch-axis index `index` of `world` reads in `fit`:
    its shard of every batch of each epoch, and of the first batch for
    Keras's build (a rank with no rows reads one sample, kept as zero).
    A `PyDataset` (not shuffled) builds whole batches: those at the
    positions `k` with `k % world == index`, and for the build, the one at
    `index` (every rank builds its batch of a group of `world` steps)."""
    sizes = _global_batches(kind)
    if kind.startswith("pydataset"):
        owned = sum(sizes[index::world])
        first = sizes[index] if index < len(sizes) else 0
        return EPOCHS * owned + first

    def reads(total):
        return _split(total, world, index, torch_chunks) or 1

    return EPOCHS * sum(reads(n) for n in sizes) + reads(sizes[0])


def _run(keras, distribution, kind):
    import models

    keras.utils.set_random_seed(6)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model = models.mlp(keras)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        dataset, loader = _loader(kind)
        dataset.reads = 0
        shuffle = kind == "pydataset_shuffled"  # the PyDataset's batches
        history = model.fit(loader, epochs=EPOCHS, verbose=0, shuffle=shuffle)
        reads = dataset.reads
        return {
            "history": history.history,
            "evaluate": model.evaluate(loader, verbose=0),
            "predict": model.predict(loader, verbose=0),
            "weights": [np.asarray(w) for w in model.get_weights()],
            "reads": reads,
        }


def _model_parallel(keras, world):
    """A batch split over a "batch" axis of size 2, with weights split
    over the other mesh axis (world 4) or over "batch" too (world 2)."""
    if world == 2:
        mesh = keras.distribution.DeviceMesh((2,), ["batch"])
        axis = "batch"
    else:
        mesh = keras.distribution.DeviceMesh(
            (2, world // 2), ["batch", "model"]
        )
        axis = "model"
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, axis)
    layout_map["mid/kernel"] = (axis, None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


_REFERENCE = {"pydataset_workers": "pydataset"}


def _cases(world):
    import keras
    import models
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    kinds = [
        "sequential",
        "shuffled",
        "global_rng",
        "weighted",
        "batch_sampler",
        "getitems",
        "workers",
        "pydataset",
        "pydataset_shuffled",
        "pydataset_dict",
        "pydataset_workers",
    ]
    for kind in kinds:
        # One process with threads reads through Keras's enqueuer, which
        # can carry a batch from one epoch into the next: the reference is
        # the same PyDataset read in order.
        reference = _run(keras, None, _REFERENCE.get(kind, kind))
        result = _run(keras, keras.distribution.DataParallel(), kind)
        out[kind] = {
            "diff": models.max_diff(reference, result),
            "reads": result["reads"],
            "expected": _expected_reads(kind, world, rank, False),
        }
    reference = _run(keras, None, "batch_sampler")
    result = _run(keras, _model_parallel(keras, world), "batch_sampler")
    out["model_parallel"] = {
        "diff": models.max_diff(reference, result),
        "reads": result["reads"],
        "expected": _expected_reads(
            "batch_sampler", 2, rank // (world // 2), True
        ),
    }
    # A shuffle seeded per rank draws different global batches: an error
    # on every rank, as for any input that differs.
    with keras.distribution.DataParallel().scope():
        model = models.mlp(keras)
        model.compile(optimizer="adam", loss="mse")
        _, loader = _loader("shuffled", seed=rank)
        try:
            model.fit(loader, epochs=1, verbose=0)
            out["diverged"] = ""
        except RuntimeError as error:
            out["diverged"] = str(error)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_its_shard_with_one_process_numbers(world):
    for rank, out in enumerate(
        run_ranks(_cases, world, world, timeout=500, children=True)
    ):
        for kind, case in out.items():
            if kind == "diverged":
                continue
            assert case["diff"] <= TOLERANCE, (world, rank, kind, case)
            if kind == "pydataset_shuffled":  # the order decides: bounded
                most = EPOCHS * 8 * -(-len(_global_batches(kind)) // world) + 8
                assert case["reads"] <= most, (world, rank, kind, case)
            elif kind != "workers":
                assert case["reads"] == case["expected"], (
                    world,
                    rank,
                    kind,
                    case,
                )
        assert "batch 0 of this epoch differs" in out["diverged"], out
