"""ModelParallel under plain `torchrun` (no PYTHONHASHSEED): each rank
hashes strings its own way, yet all choose the same collectives.

Trains a vocabulary-sharded Embedding, a column- and a row-parallel Dense
(partial sums) and a softmax loss, first on one device (no distribution),
then sharded; writes both losses, the final weights' digest and this
rank's string hash.
"""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from keras_dtensor.backend import placement_order  # noqa: E402


def build():
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(32, 8, name="embed"),
            keras.layers.Dense(16, activation="relu", name="up"),
            keras.layers.Dense(8, name="down"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(5, activation="softmax", name="head"),
        ]
    )


def train(model):
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, (32, 6)).astype("int32")
    y = rng.integers(0, 5, (32,)).astype("int32")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights = [np.asarray(w).tolist() for w in model.get_weights()]
    return history.history["loss"], weights


reference_loss, reference_weights = train(build())

devices = keras.distribution.list_devices()  # starts the group lazily
mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["embed/embeddings"] = ("model", None)
layout_map["up/kernel"] = (None, "model")
layout_map["down/kernel"] = ("model", None)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map)
)
loss, weights = train(build())
result = {
    "rank": dist.get_rank(),
    "string_hash": hash("keras_dtensor"),
    "order_digest": placement_order.order_digest(),
    "reference_loss": reference_loss,
    "loss": loss,
    "max_weight_diff": max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(weights, reference_weights, strict=True)
    ),
}
path = os.path.join(os.environ["RESULT_DIR"], f"rank{dist.get_rank()}.json")
with open(path, "w") as f:
    json.dump(result, f)
