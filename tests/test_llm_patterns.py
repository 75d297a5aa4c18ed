"""The patterns every LLM layout has, without keras_hub: same numbers as one
process.

- a vocabulary-parallel embedding (`("model", None)`) feeding a
  column-parallel layer (Megatron's layout: its masked partial output meets
  a plain partial gradient in backward);
- attention with a mask built inside `call` from integer inputs (a padding
  mask and a causal `arange` mask), after row-parallel q/k/v projections,
  so the attention backward meets a replicated mask it cannot move;
- `ops.where` with a boolean mask, integer inputs, sample weights;
- user code between calls mixing plain tensors with a model's outputs (a
  decoding loop, top-k with a new k each step).
"""

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 2e-5
VOCAB, SEQ, WIDTH, HEADS = 24, 6, 16, 4

LAYOUTS = {
    ".*embedding/embeddings": ("model", None),
    ".*(query|key|value)/kernel": ("model", None),
    ".*up/kernel": (None, "model"),
    ".*down/kernel": ("model", None),
    ".*head/kernel": (None, "model"),
}


def _model(keras):
    from keras import ops

    class MaskedSelfAttention(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.query = keras.layers.Dense(WIDTH, name="query")
            self.key = keras.layers.Dense(WIDTH, name="key")
            self.value = keras.layers.Dense(WIDTH, name="value")

        def call(self, x, padding_mask):
            shape = (-1, SEQ, HEADS, WIDTH // HEADS)
            q, k, v = (
                ops.reshape(layer(x), shape)
                for layer in (self.query, self.key, self.value)
            )
            positions = ops.arange(SEQ)
            causal = ops.greater_equal(positions[:, None], positions[None, :])
            mask = ops.logical_and(causal[None], padding_mask[:, None, :])
            out = ops.dot_product_attention(q, k, v, mask=mask[:, None])
            return ops.reshape(out, (-1, SEQ, WIDTH))

    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    padding = keras.Input((SEQ,), dtype="bool", name="padding_mask")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="embedding")(tokens)
    h = h + MaskedSelfAttention(name="attention")(h, padding)
    f = keras.layers.Dense(2 * WIDTH, activation="gelu", name="up")(h)
    h = h + keras.layers.Dense(WIDTH, name="down")(f)
    # Masked mean over the real tokens: ops.where with a boolean mask.
    keep = ops.expand_dims(padding, -1)
    total = ops.sum(ops.where(keep, h, ops.zeros_like(h)), axis=1)
    count = ops.sum(ops.cast(keep, h.dtype), axis=1)
    logits = keras.layers.Dense(VOCAB, name="head")(total / count)
    return keras.Model([tokens, padding], logits)


def _data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(32, SEQ)).astype("int32")
    lengths = rng.integers(2, SEQ + 1, size=32)
    padding = np.arange(SEQ)[None, :] < lengths[:, None]
    labels = tokens[:, 0].astype("int32")
    weights = rng.uniform(0.5, 1.5, size=32).astype("float32")
    return [tokens, padding], labels, weights


def _greedy(keras, model, prompt, steps):
    """A decoding loop written against the model's outputs (DTensors under
    a distribution) with plain tensors, as keras_hub's samplers do."""
    import torch

    tokens = torch.as_tensor(prompt)
    padding = torch.ones(tokens.shape, dtype=torch.bool)
    for step in range(steps):
        logits = model([tokens, padding])
        # top-k with a different k each step (DTensor caches by shape)
        _, best = keras.ops.top_k(logits, k=step + 2, sorted=True)
        chosen = best[:, -1]
        tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)
        tokens = keras.ops.where(
            torch.arange(SEQ) == SEQ - 1, chosen[:, None], tokens
        )
    return keras.ops.convert_to_numpy(tokens)


def _run(keras, distribution):
    import contextlib

    keras.utils.set_random_seed(5)
    x, y, w = _data()
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model = _model(keras)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        history = model.fit(
            x, y, sample_weight=w, batch_size=8, epochs=2, verbose=0
        )
        return model, {
            "history": history.history,
            "evaluate": model.evaluate(x, y, sample_weight=w, verbose=0),
            "predict": model.predict(x, batch_size=16, verbose=0),
            "weights": model.get_weights(),
            "greedy": _greedy(keras, model, x[0][:4], 3),
        }


def _patterns(mesh_shapes):
    """One spawn per world size: the reference is trained once, then each
    mesh shape's distribution."""
    import keras

    _, reference = _run(keras, None)
    return [_pattern(keras, reference, shape) for shape in mesh_shapes]


def _pattern(keras, reference, mesh_shape):
    import models

    reference = dict(reference)
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"])
    layouts = dict(LAYOUTS)
    if mesh_shape[0] > 1:
        # Gemma's: the table's features also sharded over the batch axis.
        layouts[".*embedding/embeddings"] = ("model", "batch")
    distribution = keras.distribution.ModelParallel(
        layout_map=models.layout_map(keras, mesh, layouts),
        batch_dim_name="batch",
    )
    model, result = _run(keras, distribution)
    greedy = np.abs(reference.pop("greedy") - result.pop("greedy")).max()
    local = {
        v.path: tuple(v.value.to_local().shape)
        for v in model.weights
        if v.path.endswith(("embeddings", "query/kernel", "up/kernel"))
    }
    # top_k on the same DTensor with another k: its own output shape
    # (torch 2.13 and 2.14 key topk's sharding cache without k).
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import distribute_tensor

    mesh_2d = mesh.backend_mesh
    scores = distribute_tensor(
        torch.arange(24.0).reshape(4, 6), mesh_2d, [Replicate()] * mesh_2d.ndim
    )
    local["top_k"] = [
        tuple(keras.ops.top_k(scores, k, sorted=False)[1].to_local().shape)
        for k in (5, 4)
    ]
    local.update(_einsum_and_cache(keras, mesh_2d))
    local["one_element"] = _one_element_warnings(distribution, scores)
    return models.max_diff(reference, result), int(greedy), local


def _one_element_warnings(distribution, scores):
    """torch's warnings on replicating a one-element 1-d tensor that meets
    a DTensor (keras_hub's cache index in `generate`): under the
    distribution, where plain tensors are global values, and with none."""
    import contextlib
    import warnings

    import torch

    counts = []
    for scope in (distribution.scope(), contextlib.nullcontext()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with scope:
                scores + torch.ones(1)
        counts.append(sum("numel=1" in str(w.message) for w in caught))
    return counts


def _einsum_and_cache(keras, mesh):
    """`ops.einsum` on DTensors by its subscripts, and a KV cache update,
    against the same ops on whole tensors: the largest difference of
    values and gradients, the output placements, and the collectives in
    forward. Heads: 4 (even) and 3 (uneven over 2 or 4 ranks); one
    token (where torch's own einsum gathers the kernel) and three."""
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    # A mesh axis of one process is left out of the torch mesh.
    names = mesh.mesh_dim_names

    def placed(t, model=None, batch=None):
        dims = {"model": model, "batch": batch}
        placements = [
            Replicate() if dims[name] is None else Shard(dims[name])
            for name in names
        ]
        return distribute_tensor(t, mesh, placements).requires_grad_()

    def layout(t):
        return dict(zip(names, t.placements, strict=True))

    torch.manual_seed(0)
    out = {"einsum": [], "diff": 0.0, "mesh": names}
    for heads, tokens in ((4, 1), (4, 3), (3, 1)):
        x = torch.randn(4, tokens, 8)
        w_in = torch.randn(8, heads, 2)
        w_out = torch.randn(heads, 2, 8)
        a = torch.randn(4, tokens, heads, 2)
        cases = (  # (subscripts, whole operands, their DTensors)
            # column split: q/k/v
            ("btd,dnh->btnh", (x, w_in), (placed(x), placed(w_in, 1))),
            # and with the batch over the batch axis
            ("btd,dnh->btnh", (x, w_in), (placed(x, batch=0), placed(w_in, 1))),
            # row split: the attention output
            ("btnh,nhd->btd", (a, w_out), (placed(a, 2), placed(w_out, 0))),
            # row split of a replicated input: cut, no communication
            ("btnh,nhd->btd", (a, w_out), (placed(a), placed(w_out, 0))),
        )
        for subscripts, whole, operands in cases:
            with CommDebugMode() as comm:
                result = keras.ops.einsum(subscripts, *operands)
            got = result.full_tensor()
            leaves = [t.clone().requires_grad_() for t in whole]
            want = torch.einsum(subscripts, *leaves)
            cotangent = torch.randn(want.shape)
            (got * cotangent).sum().backward()
            (want * cotangent).sum().backward()
            diffs = [(got - want).abs().max()] + [
                (o.grad.full_tensor() - leaf.grad).abs().max()
                for o, leaf in zip(operands, leaves, strict=True)
            ]
            out["diff"] = max(out["diff"], float(max(diffs)))
            out["einsum"].append(
                (subscripts, layout(result), comm.get_total_counts())
            )
    # keras_hub's KV cache: `ops.zeros` (replicated), filled with
    # head-sharded keys at the decoding position.
    cache = torch.zeros(4, 6, 4, 2)
    update = torch.randn(4, 1, 4, 2)
    operands = placed(cache).detach(), placed(update, 2).detach()
    with CommDebugMode() as comm:
        filled = keras.ops.slice_update(operands[0], (0, 2, 0, 0), operands[1])
    cache[:, 2:3] = update
    out["cache"] = (
        layout(filled),
        comm.get_total_counts(),
        float((filled.full_tensor() - cache).abs().max()),
    )
    out.update(_one_key_value_head(keras, placed, layout))
    return out


def _einsum_against_whole(keras, subscripts, whole, operands, forward=None):
    """`(result, largest difference)`: `ops.einsum` on DTensor `operands`
    against torch's on the `whole` tensors, values and gradients; the
    forward alone inside the context `forward` (a `CommDebugMode`)."""
    import contextlib

    import torch

    with forward or contextlib.nullcontext():
        result = keras.ops.einsum(subscripts, *operands)
    leaves = [t.clone().requires_grad_() for t in whole]
    want = torch.einsum(subscripts, *leaves)
    cotangent = torch.randn(want.shape)
    (result.full_tensor() * cotangent).sum().backward()
    (want * cotangent).sum().backward()
    diffs = [(result.full_tensor() - want).abs().max()] + [
        (o.grad.full_tensor() - leaf.grad).abs().max()
        for o, leaf in zip(operands, leaves, strict=True)
    ]
    return result, float(max(diffs))


def _one_key_value_head(keras, placed, layout):
    """Gemma with one key/value head (Gemma-2B's shape): the query groups
    split, the single head cut unevenly (a rank holds none of it). The
    attention einsum sees two letters sharded on the model axis; the
    cache update meets a key split one way and a cache split another."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    probs = torch.randn(4, 1, 4, 3, 3)  # b k g t s: 4 query heads, 1 k/v
    value = torch.randn(4, 3, 1, 2)  # b s k h
    comm = CommDebugMode()
    result, diff = _einsum_against_whole(
        keras,
        "bkgts,bskh->btkgh",
        (probs, value),
        (placed(probs, 2), placed(value, 2)),
        forward=comm,
    )
    out["mqa_einsum"] = layout(result), comm.get_total_counts(), diff
    # Two letters on one mesh axis, each operand the larger in turn: the
    # contracted letter kept (output a partial sum, the other operand cut
    # to it) or the free one (the other operand gathered).
    for name, (rows, cols) in {"keep_j": (16, 2), "keep_k": (2, 8)}.items():
        a, b = torch.randn(rows, 4), torch.randn(4, cols * 4)
        result, diff = _einsum_against_whole(
            keras, "ij,jk->ik", (a, b), (placed(a, 1), placed(b, 1))
        )
        out[name] = layout(result), diff
    # A cache split by its 4 heads, a replicated update; a replicated
    # cache of the one head, an update cut unevenly.
    for name, (heads, cache_dim, update_dim) in {
        "cut_update": (4, 2, None),
        "one_head": (1, None, 2),
    }.items():
        cache = torch.randn(4, 6, heads, 2)
        update = torch.randn(4, 1, heads, 2)
        operands = (
            placed(cache, cache_dim).detach(),
            placed(update, update_dim).detach(),
        )
        with CommDebugMode() as comm:
            filled = keras.ops.slice_update(
                operands[0], (0, 2, 0, 0), operands[1]
            )
        cache[:, 2:3] = update
        out[name] = (
            layout(filled),
            comm.get_total_counts(),
            float((filled.full_tensor() - cache).abs().max()),
        )
    return out


@pytest.mark.parametrize(
    "world, mesh_shapes", [(2, [(1, 2)]), (4, [(1, 4), (2, 2)])]
)
def test_llm_patterns_match_one_process(world, mesh_shapes):
    for results in run_ranks(_patterns, world, mesh_shapes):
        for mesh_shape, result in zip(mesh_shapes, results, strict=True):
            _check(mesh_shape, *result)


def _check(mesh_shape, diff, greedy, local):
    model_axis = mesh_shape[1]
    assert diff <= TOLERANCE, diff
    assert greedy == 0
    # The layout really shards: vocabulary rows, q/k/v input rows,
    # MLP columns.
    assert local["embedding/embeddings"] == (
        VOCAB // model_axis,
        WIDTH // mesh_shape[0],
    )
    assert local["attention/query/kernel"] == (WIDTH // model_axis, WIDTH)
    assert local["up/kernel"] == (WIDTH, 2 * WIDTH // model_axis)
    assert local["top_k"] == [(4, 5), (4, 4)]
    # Quiet where plain tensors are global values; torch's own warning
    # everywhere else.
    assert local["one_element"] == [0, 1], local["one_element"]
    # einsum on local shards: a column split's output stays sharded, a row
    # split's is one partial sum, nothing is gathered in forward.
    assert local["diff"] <= 1e-5, local["diff"]
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    def on(model, batch=None):
        both = {"batch": batch or Replicate(), "model": model}
        return {k: v for k, v in both.items() if k in local["mesh"]}

    column, row = on(Shard(2)), on(Partial())
    assert local["einsum"] == 3 * [
        ("btd,dnh->btnh", column, 0),
        ("btd,dnh->btnh", on(Shard(2), Shard(0)), 0),
        ("btnh,nhd->btd", row, 0),
        ("btnh,nhd->btd", row, 0),
    ], local["einsum"]
    assert local["cache"] == (on(Shard(2)), 0, 0.0)
    # One key/value head: the query groups stay split and the single
    # value head is gathered (one all-gather); a split cache takes its
    # part of a replicated key; the single head's cache stays whole.
    layout, gathers, diff = local["mqa_einsum"]
    assert (layout, gathers) == (on(Shard(3)), 1), local["mqa_einsum"]
    assert diff <= 1e-5, diff
    assert local["cut_update"] == (on(Shard(2)), 0, 0.0)
    assert local["keep_j"][0] == on(Partial()), local["keep_j"]
    assert local["keep_k"][0] == on(Shard(1)), local["keep_k"]
    assert max(local["keep_j"][1], local["keep_k"][1]) <= 1e-5
    assert local["one_head"][0] == on(Replicate()), local["one_head"]
    assert local["one_head"][2] == 0.0, local["one_head"]
