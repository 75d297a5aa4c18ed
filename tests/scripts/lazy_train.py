"""Run under torchrun without calling keras.distribution.initialize():
the process group starts lazily from torchrun's environment."""

import json
import os

import keras
import numpy as np
import torch.distributed as dist

import keras_dtensor  # noqa: F401

assert not dist.is_initialized()
devices = keras.distribution.list_devices()  # starts the group lazily
# No set_random_seed: starting the group agreed on rank 0's seed.
seed = keras.src.utils.rng_utils.get_random_seed()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if os.environ.get("FAIL_FIRST_ATTEMPT") and restart == 0 and dist.get_rank():
    raise SystemExit("rank 1 fails on purpose; torchrun restarts the job")
keras.distribution.set_distribution(keras.distribution.DataParallel())
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
x = np.arange(32, dtype="float32").reshape(8, 4) / 32
history = model.fit(x, x[:, :2], batch_size=4, epochs=2, verbose=0)
result = {
    "rank": dist.get_rank(),
    "devices": devices,
    "restart": restart,
    "seed": seed,
    "loss": history.history["loss"],
}
path = os.path.join(os.environ["RESULT_DIR"], f"rank{dist.get_rank()}.json")
with open(path, "w") as f:
    json.dump(result, f)
