"""keras_hub LLMs under ModelParallel with the layout maps keras_hub ships.

Every family whose backbone has `get_layout_map` (Gemma, with two
key/value heads and with one, Llama, Qwen, QwenMoe, Qwen3Moe) and one
without it (Mistral, with a user LayoutMap), tiny random configs,
`preprocessor=None`: the CausalLM's fit (padding masks, sample weights),
evaluate, predict and generate against the same model in one process;
Gemma LoRA-tuned. Each rank runs every case once with no distribution
(the reference) and once distributed.
"""

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multiprocess

keras_hub = pytest.importorskip("keras_hub")

TOLERANCE = 2e-5
VOCAB, SEQ = 64, 8
COMMON = dict(
    vocabulary_size=VOCAB,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
)
MOE = dict(moe_intermediate_dim=8, num_experts=4, top_k=2)
FAMILIES = {
    # name: (backbone, causal LM, extra config); tied and untied
    # embeddings, grouped-query attention, rotary embeddings, MoE routers
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(head_dim=4)),
    # one key/value head (Gemma-2B's shape): cut unevenly over the model
    # axis, a rank holds none of it
    "gemma_mqa": (
        "GemmaBackbone",
        "GemmaCausalLM",
        dict(head_dim=4, num_key_value_heads=1),
    ),
    "llama": ("LlamaBackbone", "LlamaCausalLM", {}),
    "qwen": ("QwenBackbone", "QwenCausalLM", {}),
    "qwen_moe": (
        "QwenMoeBackbone",
        "QwenMoeCausalLM",
        dict(MOE, shared_expert_intermediate_dim=16),
    ),
    "qwen3_moe": (
        "Qwen3MoeBackbone",
        "Qwen3MoeCausalLM",
        dict(MOE, head_dim=4),
    ),
    "mistral": ("MistralBackbone", "MistralCausalLM", {}),
}
# Mistral ships no layout map: the one a user writes (Llama's names).
MISTRAL_LAYOUTS = {
    "token_embedding/embeddings": ("model", None),
    "token_embedding/reverse_embeddings": (None, "model"),
    ".*self_attention.*(query|key|value).kernel": (None, "model", None),
    ".*self_attention.*attention_output.kernel": ("model", None, None),
    ".*feedforward_(gate|intermediate)_dense.kernel": (None, "model"),
    ".*feedforward_output_dense.kernel": ("model", None),
}


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(8, SEQ)).astype("int32")
    mask = np.ones((8, SEQ), bool)
    mask[:, 6:] = False
    mask[0, 3:] = False
    y = rng.integers(1, VOCAB, size=(8, SEQ)).astype("int32")
    return {"token_ids": ids, "padding_mask": mask}, y, mask.astype("float32")


def _run(family, distribution, lora=False, lora_file=None):
    import contextlib

    import keras
    import keras_hub

    backbone_cls, lm_cls, extra = FAMILIES[family]
    keras.utils.set_random_seed(0)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    x, y, w = _data()
    with scope:
        backbone = getattr(keras_hub.models, backbone_cls)(
            **{**COMMON, **extra}
        )
        lm = getattr(keras_hub.models, lm_cls)(
            backbone=backbone, preprocessor=None
        )
        if lora:
            backbone.enable_lora(rank=2)
        frozen = [
            keras.ops.convert_to_numpy(v)
            for v in backbone.weights
            if not v.trainable
        ]
        lm.compile(
            # SGD: Adam turns rounding on near-zero gradients into
            # lr-sized steps whose sign depends on the CPU (HAZARDS 19).
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        history = lm.fit(
            x, y, sample_weight=w, batch_size=4, epochs=2, verbose=0
        )
        result = {
            "history": history.history,
            "evaluate": lm.evaluate(x, y, sample_weight=w, verbose=0),
            "predict": lm.predict(x, batch_size=4, verbose=0),
            "weights": lm.get_weights(),
        }
        prompt = {
            "token_ids": x["token_ids"][:4],
            "padding_mask": x["padding_mask"][:4],
        }
        generated = {
            "greedy": lm.generate(prompt, stop_token_ids=None)["token_ids"],
        }
        lm.compile(sampler=keras_hub.samplers.TopKSampler(k=4, seed=3))
        generated["top_k"] = lm.generate(prompt, stop_token_ids=[0])[
            "token_ids"
        ]
        if lora_file is not None:
            # keras_hub writes this file itself, outside save_weights.
            backbone.save_lora_weights(lora_file)
            result["lora_saved"] = _lora_values(backbone)
        after = [
            keras.ops.convert_to_numpy(v)
            for v in backbone.weights
            if not v.trainable
        ]
        frozen_moved = max(
            [
                float(np.abs(a - b).max())
                for a, b in zip(frozen, after, strict=True)
            ]
            or [0.0]
        )
    local = {}
    if isinstance(distribution, keras.distribution.ModelParallel):
        local = {
            v.path: (tuple(v.shape), tuple(v.value.to_local().shape))
            for v in lm.weights
            if "embeddings" in v.path or "lora" in v.path or "query" in v.path
        }
        # Which of the task model's call signatures ran on local tensors
        # between its tensor-parallel layers (`boundary_layers`).
        records = lm.__dict__.get("_keras_dtensor_sharded_records")
        local["signatures"] = (
            None
            if records is None
            else sorted(r is not None for r in records[1].values())
        )
        # The layers made to run as DTensors inside the local runs, by
        # class: of the task model (fit, evaluate, predict) and of a
        # decoder block (generate calls each on its own).
        local["promoted"] = {
            "model": _promoted(lm),
            "block": _promoted(backbone.transformer_layers[0]),
        }
    return result, generated, frozen_moved, local


def _lora_values(backbone):
    import keras

    return [
        keras.ops.convert_to_numpy(v)
        for v in backbone.weights
        if "lora_kernel" in v.path
    ]


def _loaded_lora_diff(family, lora_file, saved):
    """A plain one-process backbone loads the file: its largest
    difference from the saved values."""
    import keras_hub

    backbone_cls, _, extra = FAMILIES[family]
    backbone = getattr(keras_hub.models, backbone_cls)(**{**COMMON, **extra})
    backbone.load_lora_weights(lora_file)
    loaded = _lora_values(backbone)
    assert len(loaded) == len(saved) > 0, (len(loaded), len(saved))
    return max(
        float(np.abs(a - b).max()) for a, b in zip(loaded, saved, strict=True)
    )


def _promoted(layer):
    """Per layout of the inputs, the classes of the layers promoted."""
    records = layer.__dict__.get("_keras_dtensor_sharded_records")
    names = {id(sub): type(sub).__name__ for sub in layer._flatten_layers()}
    return sorted(
        sorted(names[i] for i in state.promoted)
        for state in (records[2].values() if records else ())
    )


def _distribution(family, mesh_shape):
    import keras
    import keras_hub

    if mesh_shape == "data":
        return keras.distribution.DataParallel()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"])
    if family == "mistral":
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in MISTRAL_LAYOUTS.items():
            layout_map[key] = axes
    else:
        backbone_cls = getattr(keras_hub.models, FAMILIES[family][0])
        layout_map = backbone_cls.get_layout_map(mesh)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _families(mesh_shape, cases):
    """Rank 0 also runs each case in one process (the reference); every
    rank's distributed values are global, the same on all ranks."""
    import tempfile

    import models
    import torch.distributed as dist

    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    out = {}
    for family, lora in cases:
        reference = None
        if dist.get_rank() == 0:
            reference = _run(family, None, lora)
        distribution = _distribution(family, mesh_shape)
        lora_file = f"{directory[0]}/{family}.lora.h5" if lora else None
        got, got_gen, frozen_moved, local = _run(
            family, distribution, lora, lora_file
        )
        saved = got.pop("lora_saved", None)
        out[(family, lora)] = {"frozen_moved": frozen_moved, "local": local}
        if saved is not None and dist.get_rank() == 0:
            out[(family, lora)]["lora_loaded"] = _loaded_lora_diff(
                family, lora_file, saved
            )
        if reference is not None:
            ref, ref_gen, _, _ = reference
            out[(family, lora)]["diff"] = models.max_diff(ref, got)
            out[(family, lora)]["generate"] = {
                k: int((np.asarray(ref_gen[k]) != np.asarray(got_gen[k])).sum())
                for k in ref_gen
            }
    return out


def _check(results, mesh_shape):
    model_axis = None if mesh_shape == "data" else mesh_shape[1]
    for rank, per_rank in enumerate(results):
        for (family, lora), r in per_rank.items():
            if rank == 0:
                assert r["diff"] <= TOLERANCE, (family, lora, r["diff"])
                assert r["generate"] == {"greedy": 0, "top_k": 0}, family
            if lora:
                assert r["frozen_moved"] == 0.0, family
            if lora and rank == 0:
                # save_lora_weights on every rank: rank 0's file, whole.
                assert r["lora_loaded"] == 0.0, family
            if mesh_shape == "data":
                continue  # DataParallel: plain, whole variables
            # Every signature (fit, evaluate, predict) ran on local tensors
            # between the tensor-parallel layers, checked against DTensors
            # (the MoE router and auxiliary loss, Gemma's attention
            # reshape: as DTensors inside).
            if model_axis > 1:
                assert r["local"]["signatures"], (family, mesh_shape)
                assert all(r["local"]["signatures"]), (family, r["local"])
            # A reshape to the global head count in the attention's own
            # code runs locally (`reshapes`); with a single key/value head
            # cut unevenly, the attention runs as DTensors, decided before
            # its local run (a rank holding no head would fail alone).
            promoted = r["local"]["promoted"]
            # generate's first call gets a replicated cache, cut locally
            # to this rank's heads as the DTensor run cut it.
            if model_axis > 1 and family == "gemma":
                assert promoted["model"] and promoted["block"], promoted
                assert not any(promoted["model"] + promoted["block"]), promoted
            if model_axis > 1 and family == "gemma_mqa":
                assert any(
                    "CachedGemmaAttention" in p for p in promoted["model"]
                ), promoted
            # The layout map's weights really hold their shards.
            shape, local = r["local"]["token_embedding/embeddings"]
            assert local[0] == shape[0] // model_axis, (family, local)
            factors = [p for p in r["local"] if p.endswith("lora_kernel_a")]
            assert bool(factors) == lora, (family, factors)
            for path in factors:
                # A keeps its base kernel's input-dim layout.
                shape, local = r["local"][path]
                assert local[0] == shape[0] // model_axis, (path, local)


ALL = [(f, False) for f in FAMILIES] + [("gemma", True)]


def test_keras_hub_families_on_2_processes():
    _check(
        run_ranks(_families, 2, (1, 2), ALL, timeout=600, tensorflow=True),
        (1, 2),
    )


def test_keras_hub_under_data_parallel_on_2_processes():
    # Dense models, and MoE models whose auxiliary load-balancing loss
    # depends on the whole batch's routing (`global_batch_losses`).
    cases = [("gemma", True), ("llama", False), ("qwen_moe", False)]
    cases.append(("qwen3_moe", False))
    _check(
        run_ranks(_families, 2, "data", cases, timeout=600, tensorflow=True),
        "data",
    )


def _families_block_by_block(mesh_shape, cases):
    """`_families` with every layer its own gather group (FSDP2's blocks,
    `fsdp_blocks`): keras_hub's maps on a (2, 1) mesh shard every
    weight over "batch" only, the FSDP-style local path."""
    import os

    os.environ["KERAS_DTENSOR_GATHER_MB"] = "0.0001"
    return _families(mesh_shape, cases)


def test_keras_hub_fsdp_style_on_2_processes():
    # Untied (Llama: top-k sampling by default) and tied, LoRA-tuned
    # embeddings (Gemma): batch-sharded generation, sampling included.
    cases = [("llama", False), ("gemma", True)]
    _check(
        run_ranks(
            _families_block_by_block,
            2,
            (2, 1),
            cases,
            timeout=600,
            tensorflow=True,
        ),
        (2, 1),
    )


@pytest.mark.slow
def test_keras_hub_gemma_lora_on_a_2x2_mesh():
    # Gemma's map also shards weights over the batch axis; the batch is
    # sharded too. Slow (about 4-8 minutes: 4 processes on 2 cores), so
    # outside `make test`; `make test-slow` runs it. The model-agnostic
    # patterns run at (1, 4) and (2, 2) in test_llm_patterns.py, in CI.
    cases = [("gemma", True)]
    _check(
        run_ranks(_families, 4, (2, 2), cases, timeout=600, tensorflow=True),
        (2, 2),
    )
