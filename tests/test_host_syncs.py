"""No host syncs added: a distributed train step reads back what Keras's does.

A host sync is a point where the host waits for a computed value: a
scalar read (`aten::_local_scalar_dense`: `.item()`, `float()`, `bool()`
of a tensor), `.tolist()`, `.numpy()`, `.cpu()`, a
`torch.cuda.synchronize` or a `torch.distributed` barrier. On a GPU each
stalls the step's launches until the device catches up. Each
distribution's train step (the function `fit` calls a batch: the
distribution's own work around Keras's step included) must have as many
as plain Keras's. Plain Keras's has one today: a seeded `Dropout` reads
its seed back (`torch_seed_generator`).

Blocking waits on collectives (`Work.wait`, `_c10d_functional::
wait_tensor`) are a distribution's own cost: they are counted too and may
be at most one per collective the step issued.

Counted on the training thread, inside the train function only, by a
`TorchDispatchMode` (dispatcher ops, on DTensors and plain tensors alike:
the mode sees an op before DTensor's own dispatch) and by wrapping the
Python methods that read a value back without a dispatcher op on the CPU
(`Tensor.tolist`, `.numpy`, `.cpu`; `.item` too, to name its caller). A
positive control in every case shows both channels see a deliberate read
in the loss. (`.to("cpu")` is not counted: on a CPU-only machine it
cannot be told from Keras moving a value to its default device.)

The input checks (`input_checks`, every `KERAS_DTENSOR_CHECK_EVERY`
batches) and Keras's conversion of the logs for batch-end callbacks run
between steps, outside the counted window.
"""

import collections
import os
import threading
import traceback

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

SEQ, WIDTH = 4, 8
BATCH = 8
# Step 0 does one-time work inside the step function: Keras builds the
# optimizer's slots, DataParallel builds its gradient reducer, broadcasts
# rank 0's weights and probes the loss layers with one more forward (its
# dropout and batch-norm reads show up again); ModelParallel records a
# DTensor run of the layers it runs locally (and may check its local run
# against it by scalar fingerprints). Step 1 counts as the steps after
# it today; it is left out as a margin for work done on a second call.
# Steps 2.. are every step.
WARMUP = 2
COUNTED = 4
CONTROL = WARMUP + COUNTED  # the last step: a deliberate `.item()`
STEPS = CONTROL + 1

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(skip):
    """The call site outside torch: up to three frames, innermost first."""
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    out = []
    for frame in reversed(traceback.extract_stack()[:-skip]):
        name = frame.filename
        if name.startswith(torch_dir):
            continue
        if name.startswith(ROOT):
            name = os.path.relpath(name, ROOT)
        else:
            name = name.split(f"site-packages{os.sep}")[-1]
        out.append(f"{name}:{frame.lineno} {frame.name}")
        if len(out) == 3:
            break
    return " <- ".join(out)


class _Counter:
    """Host syncs, collectives and waits on this thread while entered,
    as `{(category, what, site): n}` in `events`."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        self.events = collections.Counter()
        # Python methods are patched for every thread: only this one's
        # calls count (Keras converts logs on a callback thread).
        self.thread = threading.get_ident()
        self.depth = 0  # inside a wrapped method: its ops are its own
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name
                space = name.split("::")[0]
                if name == "aten::_local_scalar_dense":
                    if not counter.depth:
                        counter.record("sync", name)
                elif name == "_c10d_functional::wait_tensor":
                    counter.record("wait", name)
                elif space in ("c10d", "_c10d_functional") and not (
                    name.endswith("_wrap_tensor_autograd")
                ):
                    counter.record("collective", name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

        self.patches = [
            (torch.Tensor, "item", "sync"),
            (torch.Tensor, "tolist", "sync"),
            (torch.Tensor, "numpy", "sync"),
            (torch.Tensor, "cpu", "sync"),
            (torch.cuda, "synchronize", "sync"),
            (dist, "barrier", "sync"),
            (dist, "monitored_barrier", "sync"),
            (dist.Work, "wait", "wait"),
        ]
        self.saved = []

    def record(self, category, what):
        self.events[(category, what, _where(skip=3))] += 1

    def _wrap(self, owner, name, category):
        original = getattr(owner, name)
        what = f"{getattr(owner, '__name__', owner)}.{name}"
        counter = self

        def wrapper(*args, **kwargs):
            if threading.get_ident() != counter.thread:
                return original(*args, **kwargs)
            if category == "wait" or not counter.depth:
                counter.record(category, what)
            counter.depth += category == "sync"
            try:
                return original(*args, **kwargs)
            finally:
                counter.depth -= category == "sync"

        wrapper.__wrapped__ = original
        return original, wrapper

    def __enter__(self):
        for owner, name, category in self.patches:
            original, wrapper = self._wrap(owner, name, category)
            self.saved.append((owner, name, original))
            setattr(owner, name, wrapper)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        while self.saved:
            owner, name, original = self.saved.pop()
            setattr(owner, name, original)


def _model(keras):
    """Attention, norms, dropout (random), batch statistics."""
    inputs = keras.Input((SEQ, WIDTH), name="x")
    a = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
    h = keras.layers.LayerNormalization(name="ln")(inputs + a)
    f = keras.layers.Dense(16, activation="relu", name="up")(h)
    f = keras.layers.Dropout(0.2, seed=1)(f)
    f = keras.layers.Dense(WIDTH, name="down")(f)
    h = keras.layers.BatchNormalization(name="bn")(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(2, name="out")(h)
    return keras.Model(inputs, outputs, name="net")


LAYOUTS = {
    # Tensor-parallel: heads and the MLP's hidden units split (column
    # then row), over a (1, 2) mesh.
    "tp": {
        ".*mha/(query|key|value)/kernel": (None, "model", None),
        ".*mha/(query|key|value)/bias": ("model", None),
        ".*mha/attention_output/kernel": ("model", None, None),
        ".*up/kernel": (None, "model"),
        ".*up/bias": ("model",),
        ".*down/kernel": ("model", None),
    },
    # FSDP-style: every kernel's first dimension over the batch axis.
    "fsdp": {
        ".*mha/(query|key|value|attention_output)/kernel": (
            "batch",
            None,
            None,
        ),
        ".*(up|down|out)/kernel": ("batch", None),
    },
}


def _distribution(keras, case):
    if case == "plain":
        return None
    if case == "data_parallel":
        return keras.distribution.DataParallel()
    shape, axes = {"tp": ((1, 2), ["batch", "model"])}.get(
        case, ((2,), ["batch"])
    )
    mesh = keras.distribution.DeviceMesh(shape, axes)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, value in LAYOUTS[case].items():
        layout_map[key] = value
    return keras.distribution.ModelParallel(layout_map=layout_map)


def _deliberate_sync(fn):
    """The positive control: a loss that reads its value back twice, by
    `.item()` (a Python method) and by `bool()` (a dispatcher op only)."""

    def loss(y_true, y_pred, **kwargs):
        value = fn(y_true, y_pred, **kwargs)
        total = value.sum()
        total.item()
        bool(total >= 0)
        return value

    return loss


def _counted_fit(case):
    """Trains `STEPS` steps of `_model` under `case`; returns each step's
    counted events."""
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, SEQ, WIDTH)).astype("float32")
    y = rng.normal(size=(STEPS * BATCH, 2)).astype("float32")
    distribution = _distribution(keras, case)
    keras.distribution.set_distribution(distribution)
    try:
        model = _model(keras)
        loss = keras.losses.MeanSquaredError()
        model.compile(optimizer="adam", loss=loss, metrics=["mae"])
        steps = []
        keras_loss = loss.fn

        def counted(step):
            def train_function(data):
                index = len(steps)
                if index == CONTROL:
                    loss.fn = _deliberate_sync(keras_loss)
                try:
                    with _Counter() as counter:
                        logs = step(data)
                finally:
                    loss.fn = keras_loss
                steps.append(dict(counter.events))
                return logs

            train_function.counted = True
            return train_function

        # Wraps the train function as `fit` calls it (keras_dtensor's step
        # around Keras's), once: `fit` calls `make_train_function` again.
        make = model.make_train_function

        def make_train_function(force=False):
            if getattr(model.train_function, "counted", False):
                return model.train_function
            make(force)
            model.train_function = counted(model.train_function)
            return model.train_function

        model.make_train_function = make_train_function
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
    return steps


def _worker(cases):
    return {case: _counted_fit(case) for case in cases}


@pytest.fixture(scope="module")
def counted():
    # One process group a world size: plain Keras on one process, every
    # distribution on two.
    out = run_ranks(_worker, 1, ["plain"], timeout=180)[0]
    ranks = run_ranks(_worker, 2, ["data_parallel", "tp", "fsdp"], timeout=180)
    for case in ranks[0]:
        out[case] = ranks[0][case]
        out[f"{case} (rank 1)"] = ranks[1][case]
    return out


def _of(step, category):
    return {k: n for k, n in step.items() if k[0] == category}


def _total(step, category):
    return sum(_of(step, category).values())


def _listing(steps, category, first=WARMUP, last=CONTROL):
    lines = []
    for index in range(first, last):
        events = _of(steps[index], category)
        lines.append(f"  step {index}: {sum(events.values())}")
        for (_, what, site), n in sorted(events.items()):
            lines.append(f"    {n} x {what} at {site}")
    return "\n".join(lines)


CASES = ["data_parallel", "tp", "fsdp"]


def _syncs(steps):
    """Host syncs per counted step."""
    return [sum(_of(steps[i], "sync").values()) for i in range(WARMUP, CONTROL)]


def _names(case):
    return [case, f"{case} (rank 1)"]


@pytest.mark.parametrize("case", CASES)
def test_a_distributed_step_syncs_the_host_no_more_than_plain_keras(
    counted, case
):
    plain = counted["plain"]
    for name in _names(case):
        steps = counted[name]
        assert len(steps) == len(plain) == STEPS, "the counter missed steps"
        want, got = _syncs(plain), _syncs(steps)
        assert got == want, (
            f"{name}: host syncs per train step {got}, plain Keras {want}.\n"
            f"{name}:\n{_listing(steps, 'sync')}\n"
            f"plain Keras:\n{_listing(plain, 'sync')}"
        )


@pytest.mark.parametrize("case", CASES)
def test_a_distributed_step_waits_only_on_its_own_collectives(counted, case):
    for name in _names(case):
        steps = counted[name]
        for index in range(WARMUP, CONTROL):
            waits = _total(steps[index], "wait")
            collectives = _total(steps[index], "collective")
            assert 0 < waits <= collectives, (
                f"{name}, step {index}: {waits} waits for {collectives} "
                f"collectives.\nwaits:\n"
                f"{_listing(steps, 'wait', index, index + 1)}\n"
                f"collectives:\n"
                f"{_listing(steps, 'collective', index, index + 1)}"
            )


@pytest.mark.parametrize("case", ["plain", *CASES])
def test_the_counter_sees_a_deliberate_read_in_the_step(counted, case):
    steps = counted[case]
    before = _of(steps[CONTROL - 1], "sync")
    control = _of(steps[CONTROL], "sync")
    added = collections.Counter(control)
    added.subtract(before)
    deliberate = sorted(
        (what, n)
        for (_, what, site), n in added.items()
        if n and site.split(" <- ")[0].endswith(" loss")
    )
    assert deliberate == [
        ("Tensor.item", 1),
        ("aten::_local_scalar_dense", 1),
    ], f"{case}:\n{_listing(steps, 'sync', CONTROL - 1, CONTROL + 1)}"
