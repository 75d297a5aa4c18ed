"""Small models, data and layout maps shared by the multi-process tests.

Every builder takes the `keras` module so that spawned ranks import Keras
only after the harness set the environment.
"""

import contextlib

import numpy as np

VOCAB, SEQ, WIDTH = 48, 8, 16


def mlp(keras):
    inputs = keras.Input((WIDTH,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(24, activation="tanh", name="mid")(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs, name="mlp")


def transformer(keras):
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(4, 4, name="mha")(h, h)
    h = keras.layers.LayerNormalization(name="ln1")(h + a)
    f = keras.layers.EinsumDense(
        "bsd,df->bsf", output_shape=(SEQ, 32), bias_axes="f", name="ffn_up"
    )(h)
    f = keras.layers.Activation("relu")(f)
    f = keras.layers.EinsumDense(
        "bsf,fd->bsd", output_shape=(SEQ, WIDTH), name="ffn_down"
    )(f)
    h = keras.layers.LayerNormalization(name="ln2")(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(tokens, outputs, name="transformer")


def embedding(keras):
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(tokens, outputs, name="embedding")


def odd(keras):
    """A hidden width (5) that 2 or 4 ranks cannot split evenly."""
    inputs = keras.Input((WIDTH,), name="features")
    h = keras.layers.Dense(5, activation="tanh", name="odd")(inputs)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs, name="odd")


def narrow(keras):
    """Widths (3, 1) smaller than or uneven over the mesh axis, under the
    README's own `.*dense.*kernel` -> `(None, "model")` layout."""
    inputs = keras.Input((WIDTH,), name="features")
    h = keras.layers.Dense(3, activation="tanh", name="dense_a")(inputs)
    h = keras.layers.Dense(1, name="dense_b")(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs, name="narrow")


MODELS = {
    "narrow": narrow,
    "mlp": mlp,
    "transformer": transformer,
    "embedding": embedding,
    "odd": odd,
}

# Tensor-parallel splits over the "model" axis.
TP_LAYOUTS = {
    "mlp": {
        ".*up/kernel": (None, "model"),
        ".*up/bias": ("model",),
        ".*mid/kernel": ("model", None),
    },
    "transformer": {
        ".*mha/(query|key|value)/kernel": (None, "model", None),
        ".*mha/(query|key|value)/bias": ("model", None),
        ".*mha/attention_output/kernel": ("model", None, None),
        ".*ffn_up/kernel": (None, "model"),
        ".*ffn_up/bias": ("model",),
        ".*ffn_down/kernel": ("model", None),
        ".*embed/embeddings": (None, "model"),
    },
    "narrow": {".*dense.*kernel": (None, "model"), ".*dense.*bias": ("model",)},
    # Vocabulary-parallel embedding.
    "embedding": {".*embed/embeddings": ("model", None)},
}


def fsdp_layouts(model_name, axis="batch"):
    """Every weight matrix sharded on its first dimension over `axis`."""
    keys = {
        "mlp": [".*(up|mid|out)/kernel"],
        "transformer": [
            ".*mha/(query|key|value)/kernel",
            ".*ffn_(up|down)/kernel",
            ".*embed/embeddings",
        ],
        "embedding": [".*embed/embeddings", ".*out/kernel"],
    }[model_name]
    rank_of = {".*mha/(query|key|value)/kernel": 3}
    return {k: (axis,) + (None,) * (rank_of.get(k, 2) - 1) for k in keys}


def fsdp_tp_layouts(model_name):
    """The tensor-parallel split with every sharded weight matrix's other
    first free dimension sharded over "batch" too (FSDP x TP on a 2-D
    mesh)."""
    out = {}
    for key, axes in TP_LAYOUTS[model_name].items():
        if len(axes) >= 2 and None in axes:
            free = axes.index(None)
            axes = axes[:free] + ("batch",) + axes[free + 1 :]
        out[key] = axes
    return out


def data(model_name, n=64, seed=0):
    rng = np.random.default_rng(seed)
    if model_name in ("mlp", "odd", "narrow"):
        x = rng.normal(size=(n, WIDTH)).astype("float32")
    else:
        x = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")
    y = rng.normal(size=(n, 4)).astype("float32")
    return x, y


OPTIMIZERS = {
    # The optimizer of parity tests where the optimizer is not the point:
    # SGD's update is the gradient times lr, so a wrong gradient moves the
    # weights by lr times the error and rounding stays rounding. Adam
    # divides each gradient element by its own size: rounding on a
    # near-zero gradient (whose sign depends on the CPU's kernels) becomes
    # an lr-sized step (shared/HAZARDS.md, 19).
    "sgd": lambda keras: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda keras: keras.optimizers.Adam(0.002),
    "adamw": lambda keras: keras.optimizers.AdamW(0.002, weight_decay=0.05),
    "rmsprop": lambda keras: keras.optimizers.RMSprop(0.01),
}


def layout_map(keras, mesh, layouts):
    result = keras.distribution.LayoutMap(mesh)
    for key, axes in layouts.items():
        result[key] = axes
    return result


def train(keras, model_name, optimizer, distribution=None, **fit_kwargs):
    """Builds, trains and evaluates one model; returns what it saw."""
    keras.utils.set_random_seed(3)
    x, y = data(model_name)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model = MODELS[model_name](keras)
        model.compile(
            optimizer=OPTIMIZERS[optimizer](keras),
            loss="mse",
            metrics=["mae"],
            jit_compile=fit_kwargs.pop("jit_compile", False),
        )
        history = model.fit(
            x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, **fit_kwargs
        )
        result = {
            "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=16, verbose=0),
            "predict": model.predict(x, batch_size=16, verbose=0),
            "weights": model.get_weights(),
        }
    return model, result


def max_diff(a, b):
    """Max |a - b| over two results of `train`."""
    diffs = [
        np.abs(np.asarray(p) - np.asarray(q)).max()
        for p, q in zip(a["weights"], b["weights"], strict=True)
    ]
    diffs.append(np.abs(a["predict"] - b["predict"]).max())
    diffs.append(np.abs(np.subtract(a["evaluate"], b["evaluate"])).max())
    for key in a["history"]:
        diffs.append(
            np.abs(np.subtract(a["history"][key], b["history"][key])).max()
        )
    return float(max(diffs))
