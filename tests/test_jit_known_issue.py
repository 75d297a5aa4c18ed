"""A known wrong result under jit_compile + ModelParallel, kept as a
strict xfail so that it is seen, and noticed when torch or a fix makes it
pass (then remove the mark and the README limitation).

A layer that returns its own input unchanged across a graph break, on the
test MLP's column/row layouts: the compiled forward trains different
numbers from eager with no error (loss 1.71 vs 1.82 after one epoch,
torch 2.13 CPU). Slow (a compile on 2 processes), so outside `make test`.
"""

import numpy as np
import pytest
from harness import run_ranks

TOLERANCE = 1e-5


def _identity_across_break():
    import contextlib

    import keras
    import models
    import torch

    class IdentityAcrossBreak(keras.layers.Layer):
        def call(self, x):
            h = keras.ops.relu(x)
            torch._dynamo.graph_break()
            return h

    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"])
    distribution = keras.distribution.ModelParallel(
        layout_map=models.layout_map(keras, mesh, models.TP_LAYOUTS["mlp"])
    )

    def run(distribution, jit_compile):
        keras.utils.set_random_seed(4)
        scope = distribution.scope() if distribution else None
        with scope or contextlib.nullcontext():
            inputs = keras.Input((8,))
            h = keras.layers.Dense(8, name="up")(inputs)
            h = IdentityAcrossBreak()(h)
            outputs = keras.layers.Dense(4, name="down")(h)
            model = keras.Model(inputs, outputs)
            model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
            return history.history["loss"]

    import os

    reference = run(None, False)
    os.environ["KERAS_DTENSOR_JIT"] = "1"  # off by default for this reason
    compiled = run(distribution, True)
    return float(np.max(np.abs(np.subtract(compiled, reference))))


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known: see the module docstring")
def test_identity_across_a_graph_break_under_jit_matches_eager():
    for diff in run_ranks(_identity_across_break, 2):
        assert diff <= TOLERANCE, diff
