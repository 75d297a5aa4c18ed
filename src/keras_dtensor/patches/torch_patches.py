"""The torch entries of the `PATCHES` table: torch attributes replaced, DTensor
sharding strategies registered and sharding-cache keys fixed."""

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
        "Its hash is salted per process: ranks could pick other collectives.",
        lambda original: placement_order.partial_hash,
    ),
    Patch(
        "torch.distributed.tensor.placement_types",
        "_MaskPartial.__hash__",
        "It hashes a memory address: ranks could pick other collectives.",
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
        "Its reduce-op sets iterate in per-process hash order.",
        placement_order.wrap_planner_init,
    ),
    Patch(
        "torch.distributed.tensor",
        "DTensor._stable_hash_for_caching",
        "The compile cache key names the rank, not only the spec.",
        compile_fixes.wrap_stable_hash_for_caching,
    ),
    Patch(
        "torch._functorch._aot_autograd.runtime_wrappers",
        "gen_alias_from_base",
        "A compiled view of an input is rebuilt without as_strided.",
        compile_fixes.wrap_gen_alias_from_base,
    ),
    Patch(
        "torch.distributed.tensor._redistribute",
        "_redistribute_backward",
        "Backward from P(sum) to an embedding's MaskP(...): summed first.",
        redistribute.wrap_redistribute_backward,
    ),
    Patch(
        "torch.distributed.tensor._dispatch",
        "redistribute_local_tensor",
        "Indices both gathered and masked recorded a wrong-shape mask.",
        redistribute.wrap_redistribute_local_tensor,
    ),
    Patch(
        "torch.nn.functional",
        "embedding",
        "A vocabulary-sharded table's backward computes only its entries.",
        embedding_grad.wrap_embedding,
    ),
    CacheKey(
        lambda: torch.ops.aten.topk.default,
        1,
        "torch 2.13 keys topk's sharding cache without `k`.",
    ),
    Registration(
        "comparison ops torch lacks (eq, ne, lt, le, gt, ge)",
        strategies.missing_comparisons,
        strategies.elementwise,
        "Keras's EMA compares `iterations`; torch 2.11 lacks aten.ne.Tensor.",
    ),
    Registration(
        "aten.scatter_reduce",
        strategies.scatter_reduce_ops,
        strategies.scatter_reduce,
        "No DTensor rule: segment_sum (AUC) crashed under ModelParallel.",
    ),
    Registration(
        "aten.multinomial, replicated",
        strategies.sample_ops,
        strategies.replicated_sample,
        "Each rank sampled its entries from the same stream's start.",
    ),
    Registration(
        "aten._scaled_dot_product_flash_attention_for_cpu",
        strategies.flash_cpu_ops,
        strategies.flash_cpu,
        "CPU attention has no DTensor rule: sharded MHA would crash.",
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
