"""`jit_compile=True` with nothing distributed costs what plain Keras costs.

With no distribution set, every hook must return to Keras's own code before
doing anything `torch.compile` cannot trace (a `ContextVar` read): else each
optimizer and metric update, each seeded draw, breaks the compiled step's
graph. The same short `fit`/`evaluate`/`predict` runs in one process before
and after `import keras_dtensor`: dynamo must compile as many graphs, and
break them for the same reasons only (a ContextVar read in any hook on the
step's path adds a reason of its own and fails it), and recompile as
often (a lookup of per-object state in the step guards on the object).
"""

import os
import subprocess
import sys

_SCRIPT = r"""
import json
import os

os.environ["KERAS_BACKEND"] = "torch"
import keras
import numpy as np
import torch._dynamo
from torch._dynamo.utils import counters


def counted():
    torch._dynamo.reset()
    counters.clear()
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = x[:, :2]
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.Dropout(0.2, seed=1)(h)
    h = keras.layers.GaussianNoise(0.1, seed=2)(h)
    outputs = keras.layers.Dense(2)(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer="adam", loss="mse", metrics=["mae"], jit_compile=True
    )
    # Two epochs with validation: between the compiled train steps the
    # model gains attributes (its test function), which a lookup of the
    # package's per-object state in the step would guard on: a recompile.
    model.fit(
        x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=0
    )
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    return {
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "reasons": sorted(k[:120] for k in counters["graph_break"]),
    }


plain = counted()
import keras_dtensor  # noqa: E402,F401

imported = counted()
print(json.dumps({"plain": plain, "imported": imported}))
"""


def test_compiled_step_breaks_no_more_graphs_with_the_import(tmp_path):
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, imported = counts["plain"], counts["imported"]
    assert plain["graphs"] > 0  # the step was compiled at all
    assert imported["reasons"] == plain["reasons"], imported["reasons"]
    assert imported["graphs"] == plain["graphs"]
