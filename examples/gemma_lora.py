"""LoRA-tune a tiny Gemma under ModelParallel, then generate.

The standard Keras recipe for tuning Gemma, on the torch backend with
keras-dtensor: a (1, N) mesh, keras_hub's own layout map, `enable_lora`,
`fit`, `generate`. The same script also runs the model in one process
(rank 0, no distribution) and prints the parity.

```
pip install 'keras-dtensor[hub]'
OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 \\
    examples/gemma_lora.py
```

A real Gemma loads with `keras_hub.models.GemmaCausalLM.from_preset(...)`
after `set_distribution`; its weights are then created sharded.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtensor  # noqa: E402, F401  (installs into Keras)

VOCAB, SEQ = 64, 12
CONFIG = dict(
    vocabulary_size=VOCAB,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
)


def data():
    """Token ids with right padding; the next token is the target."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(32, SEQ + 1)).astype("int32")
    mask = np.ones((32, SEQ), bool)
    mask[::3, 9:] = False
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
    return x, tokens[:, 1:], mask.astype("float32")


def tune(distribution=None):
    """Builds, LoRA-tunes and samples from the model; returns the numbers."""
    keras.utils.set_random_seed(0)
    if distribution is not None:
        keras.distribution.set_distribution(distribution)
    backbone = keras_hub.models.GemmaBackbone(**CONFIG)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(rank=4)
    lm.compile(
        optimizer=keras.optimizers.Adam(5e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"],
    )
    x, y, w = data()
    history = lm.fit(x, y, sample_weight=w, batch_size=8, epochs=3, verbose=0)
    prompt = {name: values[:2] for name, values in x.items()}
    tokens = lm.generate(prompt, stop_token_ids=None)["token_ids"]
    keras.distribution.set_distribution(None)
    return lm, history.history["loss"], np.asarray(tokens)


def main():
    import torch.distributed as dist

    keras.distribution.initialize()
    world = keras.distribution.get_device_count()
    rank = dist.get_rank()
    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    lm, losses, tokens = tune(distribution)
    reference = tune() if rank == 0 else None
    if rank == 0:
        for epoch, loss in enumerate(losses, 1):
            print(f"epoch {epoch}: loss {loss:.6f}")
        print("generated:", tokens.tolist())
        for v in lm.backbone.weights:
            if "lora" in v.path or "embeddings" in v.path:
                local = tuple(v.value.to_local().shape)
                print(f"  {v.path}: global {tuple(v.shape)}, here {local}")
        _, ref_losses, ref_tokens = reference
        diff = float(np.abs(np.subtract(losses, ref_losses)).max())
        same = bool((ref_tokens == tokens).all())
        print(
            f"parity vs one process: loss diff {diff:.2e}, tokens same: {same}"
        )


if __name__ == "__main__":
    main()
