"""The torch entries of the `PATCHES` table: torch attributes replaced, DTensor
sharding strategies registered and sharding-cache keys fixed.

Each entry declares the Keras and torch versions it applies to (by default
the whole supported range, `compat.SUPPORTED_*`); a torch outside that
range is refused at import.
"""

import torch

from keras_dtensor.backend import placement_order
from keras_dtensor.ops import compile_fixes
from keras_dtensor.ops import embedding_grad
from keras_dtensor.ops import redistribute
from keras_dtensor.ops import strategies
from keras_dtensor.patches.patch_kinds import CacheKey
from keras_dtensor.patches.patch_kinds import Patch
from keras_dtensor.patches.patch_kinds import Registration

__all__ = ["TORCH_PATCHES"]

TORCH_PATCHES = (
    Patch(
        "torch.distributed.tensor.placement_types",
        "Partial.__hash__",
        "It hashes the reduce-op string, salted per process "
        "(PYTHONHASHSEED); DTensor breaks strategy ties in set order, so "
        "ranks launched by plain torchrun could choose different "
        "collectives and hang.",
        lambda original: placement_order.partial_hash,
    ),
    Patch(
        "torch.distributed.tensor.placement_types",
        "_MaskPartial.__hash__",
        "It hashes a memory address, which differs between processes; "
        "DTensor orders strategies by hash, so ranks could choose "
        "different collectives (vocabulary-sharded Embedding).",
        lambda original: placement_order.mask_partial_hash,
    ),
    Patch(
        "torch.distributed.tensor._ops._math_ops",
        "_NormPartial.__hash__",
        "Its norm type may be a string ('fro'), salted per process.",
        lambda original: placement_order.norm_partial_hash,
    ),
    Patch(
        "torch.distributed.tensor._redistribute",
        "DTensorRedistributePlanner.__init__",
        "Its sets of target reduce-op strings iterate in per-process "
        "string-hash order; insertion-ordered sets make the planned "
        "collectives agree across ranks.",
        placement_order.wrap_planner_init,
    ),
    Patch(
        "torch.distributed.tensor",
        "DTensor._stable_hash_for_caching",
        "torch keys a DTensor in its on-disk compile cache (AOTAutograd) "
        "by the spec alone, the same on every rank; ranks of one machine "
        "share the cache, and a warm run loaded another rank's compiled "
        "forward: different numbers, no error. The key names the rank.",
        compile_fixes.wrap_stable_hash_for_caching,
    ),
    Patch(
        "torch._functorch._aot_autograd.runtime_wrappers",
        "gen_alias_from_base",
        "torch 2.13 rebuilds a compiled piece's output that is a view of its "
        "input with as_strided, which DTensor refuses: jit_compile fell back "
        "to eager on Keras's MultiHeadAttention (a transposed view across a "
        "graph break) and keras_hub's Qwen-MoE (a reshape). A permutation "
        "is rebuilt with permute, a reshape with view.",
        compile_fixes.wrap_gen_alias_from_base,
    ),
    Patch(
        "torch.distributed.tensor._redistribute",
        "_redistribute_backward",
        "A vocabulary-sharded embedding's masked partial output meets a "
        "plain partial gradient from a column-parallel layer: 'Redistribution"
        " from one partial type (P(sum)) to another (MaskP(...)) is "
        "unsupported' in backward. The gradient is summed first.",
        redistribute.wrap_redistribute_backward,
    ),
    Patch(
        "torch.distributed.tensor._dispatch",
        "redistribute_local_tensor",
        "Indices that must be both gathered (batch-sharded input) and "
        "masked (vocabulary-sharded table) record their mask before the "
        "gather: a wrong-shape mask (keras_hub Gemma on a 2 x 2 mesh).",
        redistribute.wrap_redistribute_local_tensor,
    ),
    Patch(
        "torch.nn.functional",
        "embedding",
        "A table sharded on its entries (vocabulary-parallel) gets its "
        "gradient from DTensor's embedding_dense_backward replicated: the "
        "whole table's gradient on every rank. Its lookup goes through an "
        "autograd function whose backward computes this rank's entries only.",
        embedding_grad.wrap_embedding,
    ),
    CacheKey(
        lambda: torch.ops.aten.topk.default,
        1,
        "torch 2.13 keys topk's sharding cache from `dim` on, without `k`: "
        "a later topk with another k gets the first one's output shape "
        "(keras_hub's TopKSampler in generate).",
    ),
    Registration(
        "comparison ops torch lacks (eq, ne, lt, le, gt, ge)",
        strategies.missing_comparisons,
        strategies.elementwise,
        "Keras's optimizer EMA compares `iterations`; torch 2.11 has no "
        "DTensor rule for aten.ne.Tensor (2.13 has all: nothing registered).",
    ),
    Registration(
        "aten.scatter_reduce",
        strategies.scatter_reduce_ops,
        strategies.scatter_reduce,
        "No DTensor rule in torch 2.13: Keras's segment_sum, and so every "
        "thresholded metric (AUC, Precision(thresholds=...)), crashed under "
        "ModelParallel.",
    ),
    Registration(
        "aten.multinomial, replicated",
        strategies.sample_ops,
        strategies.replicated_sample,
        "torch samples each rank's entries of a batch-sharded DTensor from the "
        "start of the same generator stream: keras.random.categorical and "
        "keras_hub's samplers would draw other tokens than one process.",
    ),
    Registration(
        "aten._scaled_dot_product_flash_attention_for_cpu",
        strategies.flash_cpu_ops,
        strategies.flash_cpu,
        "CPU attention has no DTensor rule: head- or batch-sharded "
        "MultiHeadAttention would crash.",
        refine=strategies.keep_kwargs_in_place,
    ),
    Registration(
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
        strategies.flash_cpu_backward_ops,
        strategies.flash_cpu_backward,
        "Its backward, likewise.",
        refine=strategies.keep_kwargs_in_place,
    ),
)
