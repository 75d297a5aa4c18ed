"""The only code that touches Keras or torch internals: the `PATCHES` table.

Two kinds of rows:

- `Patch`: one attribute of Keras or torch (`module`, dotted
  `attribute`), why it is replaced, the versions of its package it was
  checked against, and a factory that builds the replacement from the
  original.
- `Registration`: a DTensor sharding strategy registered for torch ops
  (through the public `register_sharding`), with the rule it replaces
  saved.

`apply()` checks every row's versions before touching anything, is
idempotent, and tags every replacement; `restore()` puts back only what
still holds our replacement (someone else's later wrapper is left alone,
with a warning), then takes off the attributes hooks set on single
objects (`instance_patches`), so `keras_dtensor.uninstall()` leaves Keras
and torch as they were.
"""

import functools

import torch

from keras_dtensor import data_parallel
from keras_dtensor.backend import context
from keras_dtensor.backend import object_state
from keras_dtensor.backend import placement_order
from keras_dtensor.compat import SUPPORTED_TORCH
from keras_dtensor.hooks import callbacks
from keras_dtensor.hooks import data
from keras_dtensor.hooks import fit
from keras_dtensor.hooks import jit
from keras_dtensor.hooks import layer_call
from keras_dtensor.hooks import replicas
from keras_dtensor.hooks import shared_files
from keras_dtensor.hooks import variables
from keras_dtensor.ops import einsum
from keras_dtensor.ops import embedding_grad
from keras_dtensor.ops import sharded_adam
from keras_dtensor.ops import strategies
from keras_dtensor.patches import rows
from keras_dtensor.patches.rows import CacheKey
from keras_dtensor.patches.rows import Patch
from keras_dtensor.patches.rows import Registration
from keras_dtensor.saving import collective
from keras_dtensor.saving import sliced_load
from keras_dtensor.saving import stores

__all__ = [
    "PATCHES",
    "Patch",
    "Registration",
    "apply",
    "is_applied",
    "restore",
    "status",
]


def _backend_module(original):
    from keras_dtensor.backend import distribution_lib

    return distribution_lib


_BACKEND = "keras.src.backend"
_TORCH_CORE = "keras.src.backend.torch.core"

PATCHES = (
    Patch(
        _BACKEND,
        "distribution_lib",
        "Keras sets it to None for torch; every keras.distribution call "
        "goes through it.",
        _backend_module,
    ),
    Patch(
        "keras.src.distribution.distribution_lib",
        "distribution_lib",
        "keras.distribution binds the backend module a second time, at import.",
        _backend_module,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._initialize",
        "A variable created under a distribution must hold a DTensor laid "
        "out by Distribution.get_variable_layout, as on JAX.",
        variables.wrap_initialize,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._initialize_with_initializer",
        "The layout (and with it the process group and the agreed seed) "
        "must exist before the initializer draws the value.",
        variables.wrap_initialize_with_initializer,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._direct_assign",
        "assign/set_weights/load_weights pass global values; copy_ into a "
        "DTensor needs them laid out first.",
        variables.wrap_direct_assign,
    ),
    Patch(
        _TORCH_CORE,
        "convert_to_numpy",
        "Variable.__array__ and the optimizers convert through this "
        "binding; a DTensor must be gathered to its global value.",
        variables.wrap_convert_to_numpy,
    ),
    Patch(
        "keras.src.backend.torch",
        "convert_to_numpy",
        "Second binding of convert_to_numpy (package re-export).",
        variables.wrap_convert_to_numpy,
    ),
    Patch(
        _BACKEND,
        "convert_to_numpy",
        "Third binding: keras.ops, saving and predict call "
        "backend.convert_to_numpy.",
        variables.wrap_convert_to_numpy,
    ),
    Patch(
        "keras.src.trainers.data_adapters",
        "get_data_adapter",
        "Keras rejects every input but tf.data in multi-process runs; "
        "here every input yields the global batch and is sliced per rank.",
        data.wrap_get_data_adapter,
    ),
    Patch(
        "keras.src.backend.torch.trainer",
        "TorchEpochIterator._get_iterator",
        "Batches must enter the step as DTensors sharded along the batch "
        "axis (else: 'got mixed torch.Tensor and DTensor').",
        data.wrap_get_iterator,
    ),
    *(
        Patch(
            "keras.src.backend.torch.trainer",
            f"TorchTrainer.make_{kind}_function",
            f"{kind}_on_batch passes the user's arrays straight to the "
            "step; y and sample_weight must be DTensors like y_pred.",
            functools.partial(data.wrap_make_function, kind=kind),
        )
        for kind in ("train", "test", "predict")
    ),
    Patch(
        "keras.src.trainers.trainer",
        "Trainer.get_metrics_result",
        "DataParallel: each rank's metric states cover its rows; logged "
        "values must be the global ones.",
        data_parallel.wrap_get_metrics_result,
    ),
    Patch(
        "keras.src.trainers.trainer",
        "Trainer._compute_loss",
        "DataParallel: Keras updates compiled metrics after the optimizer "
        "step, so summing them was one more collective every step; they "
        "are updated with the loss and summed while backward runs.",
        data_parallel.wrap_compute_loss,
    ),
    Patch(
        "keras.src.trainers.trainer",
        "Trainer.compute_loss",
        "DataParallel: a batch with fewer rows than processes leaves some "
        "ranks none; Keras's loss over no rows is an empty tensor, whose "
        "backward raises. There it is a zero that contributes nothing.",
        data_parallel.wrap_compute_loss_without_rows,
    ),
    Patch(
        "keras.src.trainers.trainer",
        "Trainer.compute_metrics",
        "DataParallel: the compiled metrics of this train step were "
        "already updated with the loss; only their results are read.",
        data_parallel.wrap_compute_metrics,
    ),
    *(
        Patch(
            module,
            f"{cls}._backend_update_step",
            "DataParallel: every rank applying the whole update repeats the "
            "same work; each updates the variables it owns, then they are "
            "broadcast (ZeRO stage 1 on whole variables).",
            data_parallel.wrap_backend_update_step,
        )
        for module, cls in (
            ("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
            (
                "keras.src.backend.torch.optimizers.torch_parallel_optimizer",
                "TorchParallelOptimizer",
            ),
        )
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer._filter_empty_gradients",
        "Backward can leave a gradient partial or sharded along another "
        "dim (Dense(1) under (None, 'model')); the optimizer's in-place "
        "update then fails. Gradients are laid out as their variables.",
        variables.wrap_filter_empty_gradients,
    ),
    Patch(
        "keras.src.backend.torch.optimizers.torch_adam",
        "Adam._parallel_update_step",
        "Keras's Adam (and AdamW) holds three temporaries the size of all "
        "weights at once: on sharded weights, 3 extra shards per rank at "
        "each step's peak (torch's Adam: 1). Under a distribution it runs "
        "on local shards in bounded pieces, the same arithmetic.",
        sharded_adam.wrap_adam_update,
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer.add_variable_from_reference",
        "A split update leaves a slot stale off its variable's owner; "
        "bringing it back needs to know its variable.",
        data_parallel.wrap_add_variable_from_reference,
    ),
    Patch(
        "keras.src.backend.torch.random",
        "dropout",
        "Under DataParallel a seeded Dropout drew its mask for this rank's "
        "rows only: every rank got the first rows of one process's mask. "
        "It draws the global mask and keeps this rank's rows.",
        data_parallel.wrap_dropout,
    ),
    *(
        Patch(
            "keras.src.backend.torch.random",
            name,
            "Seeded draws shaped like the batch (GaussianNoise, "
            "augmentation layers, keras.random in call) under DataParallel: "
            "this rank's rows of the global draw, as for dropout.",
            data_parallel.wrap_shaped_draw,
        )
        for name in data_parallel.SHAPED_DRAWS
    ),
    Patch(
        "keras.src.layers.normalization.batch_normalization",
        "BatchNormalization.__init__",
        "synchronized=True raised 'only supported with the TensorFlow "
        "backend'; under DataParallel it means global-batch statistics "
        "(the default there, as on JAX, unless SYNC_BATCH_NORM=0).",
        data_parallel.wrap_batch_norm_init,
    ),
    Patch(
        "keras.src.backend.torch.nn",
        "moments",
        "Its synchronized=True raised; under DataParallel on N processes it "
        "computes the global batch's mean and variance (one all-reduce), "
        "flag or not unless SYNC_BATCH_NORM=0.",
        data_parallel.wrap_moments,
    ),
    Patch(
        "keras.src.backend.torch.trainer",
        "TorchTrainer.fit",
        "DataParallel splits optimizer updates only inside fit, and its "
        "end must bring the slots stale off their owner back; callbacks' "
        "file operations are shared (as evaluate/predict below); replicas "
        "of the weights are compared when it returns (silent divergence).",
        lambda original: fit.wrap_trainer_call(
            replicas.wrap_fit(data_parallel.wrap_fit(original))
        ),
    ),
    *(
        Patch(
            "keras.src.backend.torch.trainer",
            f"TorchTrainer.{method}",
            "Callbacks' file operations on N processes: rank 0 performs "
            "each, every rank gets its outcome (shared_files.py); a failed "
            "collective says a peer died or stalled (fit.py).",
            fit.wrap_trainer_call,
        )
        for method in ("evaluate", "predict")
    ),
    *(
        Patch(
            "keras.src.utils.file_utils",
            name,
            "Every rank ran BackupAndRestore/ModelCheckpoint/CSVLogger's "
            "directory creation, copies and deletes on shared paths: "
            "FileExistsError/FileNotFoundError, then a hang. Inside fit/"
            "evaluate/predict, rank 0 acts and every rank gets its outcome.",
            functools.partial(shared_files.wrap_file_operation, name=name),
        )
        for name in shared_files.FILE_OPERATIONS
    ),
    Patch(
        "keras.src.callbacks.tensorboard",
        "TensorBoard.set_model",
        "Every rank wrote its own event files into the shared log_dir "
        "(one run per rank); the others write to a scratch directory.",
        shared_files.wrap_tensorboard_set_model,
    ),
    Patch(
        "keras.src.backend.torch.trainer",
        "TorchTrainer._should_torch_compile",
        "torch.compile of the whole train_step fails on DTensor tangents "
        "after the graph break at loss.backward(); compile the forward.",
        jit.wrap_should_torch_compile,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__getitem__",
        "load_weights/load_model read every variable whole on every rank: "
        "a model that fits only sharded could not be loaded. Under a "
        "distribution the store hands out the dataset, read lazily.",
        sliced_load.wrap_h5_store_getitem,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._convert_to_tensor",
        "A sharded variable assigned from the lazy dataset reads only this "
        "rank's slices of it (sliced_load.py).",
        sliced_load.wrap_convert_variable_value,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_weights_only",
        "Every rank must take part (shards travel to rank 0); only rank 0 "
        "may write (h5py's lock), atomically.",
        functools.partial(collective.wrap_save, what="save_weights"),
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_model",
        "model.save: as save_weights_only.",
        functools.partial(collective.wrap_save, what="save"),
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__setitem__",
        "Converting a sharded variable to numpy gathered it whole on every "
        "rank (2x the model per rank while saving); inside a save rank 0 "
        "writes it in pieces from the shards' owners (stream_save.py).",
        stores.wrap_h5_store_setitem,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "ShardedH5IOStore.__setitem__",
        "save_weights(max_shard_size=...) converted every variable to "
        "numpy first (a whole gather) to size its shard files; inside a "
        "save a sharded value passes as its shape and dtype and is "
        "written in pieces (stores.py).",
        stores.wrap_sharded_h5_store_setitem,
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer.save_own_variables",
        "It stores variable.numpy(), a whole gather of every sharded slot "
        "on every rank; inside a save the store gets the variable.",
        stores.wrap_optimizer_save_own_variables,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "_save_model_to_fileobj",
        "model.save built the whole weights file in memory on rank 0 (a "
        "BytesIO, then a copy), or in a temporary file copied into the "
        "zip (written twice); inside a save h5py writes it in place in "
        "the zip (zip_stream.py).",
        collective.wrap_save_model_to_fileobj,
    ),
    Patch(
        "keras.src.utils.io_utils",
        "print_msg",
        "Progress bars and callback messages print once, from rank 0.",
        callbacks.wrap_print_msg,
    ),
    Patch(
        "keras.src.callbacks.callback_list",
        "CallbackList._configure_async_dispatch",
        "Batch-end callbacks on a worker thread gather DTensors out of "
        "order with the main thread's collectives: rank-divergent.",
        callbacks.wrap_configure_async_dispatch,
    ),
    Patch(
        "keras.src.layers.layer",
        "Layer.add_loss",
        "DataParallel: a loss a layer adds from its whole input (an MoE "
        "load-balancing loss, an activity regularizer) was each rank's "
        "own; the layer is marked, and runs over the global batch.",
        data_parallel.wrap_add_loss,
    ),
    Patch(
        "keras.src.layers.layer",
        "Layer.__call__",
        "Eager model(x) outside fit gets plain inputs; the outermost call "
        "lays them out like a fit batch, and tensors a layer creates are "
        "global values.",
        layer_call.wrap_call,
    ),
    Patch(
        "keras.src.random.seed_generator",
        "SeedGenerator.next",
        "The state is a replicated DTensor under a distribution, the "
        "increment a plain tensor: mixed, wherever keras.random draws.",
        layer_call.wrap_seed_generator_next,
    ),
    Patch(
        "keras.src.backend.torch.numpy",
        "einsum",
        "torch's einsum over DTensors reshapes a sharded dim into a merged "
        "one for some shapes (one token at a time in generate) and then "
        "gathers the kernel or all-reduces a column split's output; the "
        "subscripts say the layout, as for mm.",
        einsum.wrap_einsum,
    ),
    Patch(
        _TORCH_CORE,
        "slice_update",
        "With tensor start indices it writes by index_put_, which DTensor "
        "cannot run in place on a sharded tensor (a KV cache in generate).",
        strategies.wrap_slice_update,
    ),
    *(
        Patch(
            module,
            "distribute_tensor",
            "DataParallel keeps tensors plain; a tensor laid out by hand (the "
            "inputs of keras_hub's generate) would be a DTensor meeting plain "
            "variables.",
            data_parallel.wrap_distribute_tensor,
        )
        for module in (
            "keras.src.distribution.distribution_lib",
            "keras.src.distribution",
            "keras.distribution",
        )
    ),
    *(
        Patch(
            module,
            "set_distribution",
            "Plain tensors are global values while a distribution is set, as "
            "on JAX: keras_hub's generate loop or user code between calls "
            "would raise 'got mixed torch.Tensor and DTensor'. Meanwhile a "
            "warnings filter quiets torch's 'non-scalar tensor with "
            "numel=1' warning, printed on every rank.",
            context.wrap_set_distribution,
        )
        for module in (
            "keras.src.distribution.distribution_lib",
            "keras.src.distribution",
            "keras.distribution",
        )
    ),
    Patch(
        "torch.distributed.tensor.placement_types",
        "Partial.__hash__",
        "It hashes the reduce-op string, salted per process "
        "(PYTHONHASHSEED); DTensor breaks strategy ties in set order, so "
        "ranks launched by plain torchrun could choose different "
        "collectives and hang.",
        lambda original: placement_order.partial_hash,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.distributed.tensor.placement_types",
        "_MaskPartial.__hash__",
        "It hashes a memory address, which differs between processes; "
        "DTensor orders strategies by hash, so ranks could choose "
        "different collectives (vocabulary-sharded Embedding).",
        lambda original: placement_order.mask_partial_hash,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.distributed.tensor._ops._math_ops",
        "_NormPartial.__hash__",
        "Its norm type may be a string ('fro'), salted per process.",
        lambda original: placement_order.norm_partial_hash,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.distributed.tensor._redistribute",
        "DTensorRedistributePlanner.__init__",
        "Its sets of target reduce-op strings iterate in per-process "
        "string-hash order; insertion-ordered sets make the planned "
        "collectives agree across ranks.",
        placement_order.wrap_planner_init,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.distributed.tensor",
        "DTensor._stable_hash_for_caching",
        "torch keys a DTensor in its on-disk compile cache (AOTAutograd) "
        "by the spec alone, the same on every rank; ranks of one machine "
        "share the cache, and a warm run loaded another rank's compiled "
        "forward: different numbers, no error. The key names the rank.",
        jit.wrap_stable_hash_for_caching,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch._functorch._aot_autograd.runtime_wrappers",
        "gen_alias_from_base",
        "torch 2.13 rebuilds a compiled piece's output that is a view of its "
        "input with as_strided, which DTensor refuses: jit_compile fell back "
        "to eager on Keras's MultiHeadAttention (a transposed view across a "
        "graph break) and keras_hub's Qwen-MoE (a reshape). A permutation "
        "is rebuilt with permute, a reshape with view.",
        jit.wrap_gen_alias_from_base,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.distributed.tensor._redistribute",
        "_redistribute_backward",
        "A vocabulary-sharded embedding's masked partial output meets a "
        "plain partial gradient from a column-parallel layer: 'Redistribution"
        " from one partial type (P(sum)) to another (MaskP(...)) is "
        "unsupported' in backward. The gradient is summed first.",
        strategies.wrap_redistribute_backward,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.distributed.tensor._dispatch",
        "redistribute_local_tensor",
        "Indices that must be both gathered (batch-sharded input) and "
        "masked (vocabulary-sharded table) record their mask before the "
        "gather: a wrong-shape mask (keras_hub Gemma on a 2 x 2 mesh).",
        strategies.wrap_redistribute_local_tensor,
        package="torch",
        versions=str(SUPPORTED_TORCH),
    ),
    Patch(
        "torch.nn.functional",
        "embedding",
        "A table sharded on its rows (vocabulary-parallel) gets its "
        "gradient from DTensor's embedding_dense_backward replicated: the "
        "whole table's gradient on every rank. Its lookup goes through an "
        "autograd function whose backward computes this rank's rows only.",
        embedding_grad.wrap_embedding,
        package="torch",
        versions=str(SUPPORTED_TORCH),
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
        "aten.multinomial, replicated",
        strategies.sample_ops,
        strategies.replicated_sample,
        "torch samples each rank's rows of a batch-sharded DTensor from the "
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

# Saved originals: {target: what the row's apply() returned}.
_ORIGINALS = {}


def is_applied() -> bool:
    """Whether the table is currently applied."""
    return bool(_ORIGINALS)


def apply():
    """Applies every row of `PATCHES`, once.

    Raises:
        RuntimeError: the installed Keras or torch is outside a row's
            range (checked for all rows before anything is replaced).
    """
    if not is_applied():
        rows.apply_rows(PATCHES, _ORIGINALS)


def restore():
    """Restores the originals of every row we still own, and the attributes
    set on single objects."""
    rows.restore_rows(PATCHES, _ORIGINALS)
    object_state.restore()


def status():
    """One row per patch: `(target, state, why)`; state is `"applied"`,
    `"original"` or `"replaced by another library"`."""
    return rows.row_status(PATCHES, _ORIGINALS)
