"""CUDA/NCCL smoke check: run on a GPU machine, one process per GPU.

    python -m torch.distributed.run --standalone --nproc_per_node=1 \\
        scripts/cuda_check.py

For ModelParallel and DataParallel it checks that every variable (and
optimizer slot) lives on this process's GPU, that numpy and DataLoader input
reach the GPU, and that fit/evaluate/predict/save/load give the numbers of
plain single-process Keras on the same GPU. Prints one line per check from
rank 0; exits non-zero on the first mismatch. Not part of the test suite
(CI has no GPU).
"""

import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import keras_dtensor  # noqa: E402, F401

TOLERANCE = 1e-5


def build():
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(32, name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 32)).astype("float32")
    return x, rng.normal(size=(96, 4)).astype("float32")


def train(distribution, loader):
    keras.utils.set_random_seed(0)
    x, y = data()
    with distribution.scope() if distribution else _null():
        model = build()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        if loader:
            ds = torch.utils.data.TensorDataset(
                torch.from_numpy(x), torch.from_numpy(y)
            )
            history = model.fit(
                torch.utils.data.DataLoader(ds, batch_size=16),
                shuffle=False,
                epochs=2,
                verbose=0,
            )
        else:
            history = model.fit(
                x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
            )
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
        predicted = model.predict(x, batch_size=16, verbose=0)
    return model, history.history["loss"], evaluated, predicted


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def devices(model):
    found = set()
    for v in model.variables + model.optimizer.variables:
        value = v.value
        if isinstance(value, DTensor):
            found.add(f"DTensor mesh {value.device_mesh.device_type}")
            value = value.to_local()
        found.add(str(value.device))
    return found


def main():
    keras.distribution.initialize()
    from keras_dtensor.backend import distribution_lib

    rank = distribution_lib.process_id()
    world = distribution_lib.num_processes()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"torch {torch.__version__}, keras {keras.__version__}, {world} proc")
    say(f"devices {keras.distribution.list_devices()}")
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["up/kernel"] = (None, "model")
    layouts["up/bias"] = ("model",)
    layouts["down/kernel"] = ("model", None)
    cases = {
        "ModelParallel": lambda: keras.distribution.ModelParallel(
            layout_map=layouts
        ),
        "DataParallel": lambda: keras.distribution.DataParallel(),
    }
    failed = False
    for loader in (False, True):
        reference = train(None, loader)
        for name, make in cases.items():
            model, loss, evaluated, predicted = train(make(), loader)
            diff = max(
                np.abs(np.asarray(a) - np.asarray(b)).max()
                for a, b in zip(
                    [loss, evaluated, predicted] + model.get_weights(),
                    list(reference[1:]) + reference[0].get_weights(),
                    strict=True,
                )
            )
            where = devices(model)
            kind = "cuda" if torch.cuda.is_available() else "cpu"
            on_device = all(
                d.startswith((kind, f"DTensor mesh {kind}")) for d in where
            )
            # one path for every process of this node
            path = os.path.join(tempfile.gettempdir(), f"kd_check_{name}.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
            load_diff = max(
                np.abs(a - b).max()
                for a, b in zip(
                    loaded.get_weights(), model.get_weights(), strict=True
                )
            )
            ok = diff <= TOLERANCE and on_device and load_diff == 0
            failed |= not ok
            say(
                f"{name:14} {'DataLoader' if loader else 'numpy':10} "
                f"max diff {diff:.2e}  reload diff {load_diff:.1e}  "
                f"devices {sorted(where)}  {'OK' if ok else 'FAIL'}"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
