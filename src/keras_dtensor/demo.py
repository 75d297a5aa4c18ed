"""The main job: a small transformer trained with ModelParallel.

Run by `keras-dtensor demo`: the same model from the same seed, as plain
Keras on rank 0 and with `ModelParallel` on all ranks; it prints the
losses, the weights' layouts and local shapes, and the parity.
"""

import argparse
import contextlib
import os
import sys

__all__ = ["build_model", "layout_map", "main"]

VOCAB, SEQ, D_MODEL, HEADS, MLP = 64, 16, 32, 4, 64
TOLERANCE = 1e-5


def build_model(keras):
    """A one-block transformer classifier (Embedding, MHA, LN, MLP)."""
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, D_MODEL, name="embedding")(tokens)
    a = keras.layers.MultiHeadAttention(
        HEADS, D_MODEL // HEADS, name="attention"
    )(h, h)
    h = keras.layers.LayerNormalization(name="norm1")(h + a)
    f = keras.layers.Dense(MLP, activation="gelu", name="mlp_up")(h)
    f = keras.layers.Dense(D_MODEL, name="mlp_down")(f)
    h = keras.layers.LayerNormalization(name="norm2")(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    logits = keras.layers.Dense(VOCAB, name="head")(h)
    return keras.Model(tokens, logits, name="transformer")


def layout_map(keras, mesh):
    """Megatron-style split: heads and MLP columns over the 'model' axis."""
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*attention/(query|key|value)/kernel"] = (None, "model", None)
    layouts[".*attention/(query|key|value)/bias"] = ("model", None)
    layouts[".*attention/attention_output/kernel"] = ("model", None, None)
    layouts[".*mlp_up/kernel"] = (None, "model")
    layouts[".*mlp_up/bias"] = ("model",)
    layouts[".*mlp_down/kernel"] = ("model", None)
    layouts[".*embedding/embeddings"] = (None, "model")
    return layouts


def _train(keras, np, epochs, distribution=None, callbacks=()):
    x = np.random.default_rng(0).integers(0, VOCAB, size=(256, SEQ))
    x = x.astype("int32")
    y = (x[:, :4].sum(axis=1) % VOCAB).astype("int32")
    keras.utils.set_random_seed(42)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model = build_model(keras)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        history = model.fit(
            x,
            y,
            batch_size=32,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
        weights = model.get_weights()
    return model, history.history, weights


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    from keras_dtensor.backend import distribution_lib  # installs into Keras

    keras.distribution.initialize()
    rank = distribution_lib.process_id()
    world = distribution_lib.num_processes()

    def say(*parts):
        if rank == 0:
            print(*parts, flush=True)

    say(f"keras-dtensor demo: {world} processes, ModelParallel")
    reference = _train(keras, np, args.epochs) if rank == 0 else None

    mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map(keras, mesh)
    )
    log = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: say(
            f"epoch {epoch + 1}: loss {logs['loss']:.6f} "
            f"accuracy {logs['accuracy']:.4f}"
        )
    )
    model, history, weights = _train(
        keras, np, args.epochs, distribution, callbacks=[log]
    )

    say(f"\n{'weight':44} {'axes':22} {'global':14} local (rank 0)")
    for v in model.trainable_weights:
        layout = distribution.get_variable_layout(v)
        local = tuple(v.value.to_local().shape)
        say(
            f"{v.path:44} {str(layout.axes):22} "
            f"{str(tuple(v.shape)):14} {local}"
        )
    if rank != 0:
        return 0
    _, ref_history, ref_weights = reference
    diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(weights, ref_weights, strict=True)
    )
    losses = zip(history["loss"], ref_history["loss"], strict=True)
    loss_diff = max(abs(a - b) for a, b in losses)
    ok = diff <= TOLERANCE and loss_diff <= TOLERANCE
    say(
        f"\nparity vs one process: max |weight diff| {diff:.2e}, "
        f"max |loss diff| {loss_diff:.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {TOLERANCE:g})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "torch")
    sys.exit(main())
