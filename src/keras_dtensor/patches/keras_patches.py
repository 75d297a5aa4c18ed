"""The Keras entries of the `PATCHES` table: attributes of Keras replaced."""

import functools

from keras_dtensor import data_parallel
from keras_dtensor import model_parallel
from keras_dtensor.backend import context
from keras_dtensor.backend import distribution_lib
from keras_dtensor.compat import KERAS
from keras_dtensor.compat import KERAS_3_15
from keras_dtensor.hooks import attention
from keras_dtensor.hooks import callbacks
from keras_dtensor.hooks import data
from keras_dtensor.hooks import dropout
from keras_dtensor.hooks import fit_guard
from keras_dtensor.hooks import jit
from keras_dtensor.hooks import layer_call
from keras_dtensor.hooks import output_layouts
from keras_dtensor.hooks import replicate_check
from keras_dtensor.hooks import shared_files
from keras_dtensor.hooks import slice_update
from keras_dtensor.hooks import variables
from keras_dtensor.ops import sharded_adam
from keras_dtensor.patches.patch_kinds import Patch

__all__ = ["KERAS_PATCHES"]


def _backend_module(original):
    return distribution_lib


_BACKEND = "keras.src.backend"
_TRAINER = "keras.src.backend.torch.trainer"
KERAS_PATCHES = (
    Patch(
        _BACKEND,
        "distribution_lib",
        "None for torch in Keras; every keras.distribution call uses it.",
        _backend_module,
    ),
    Patch(
        "keras.src.distribution.distribution_lib",
        "distribution_lib",
        "keras.distribution binds the backend module a second time, at import.",
        _backend_module,
    ),
    Patch(
        "keras.src.distribution.distribution_lib",
        "ModelParallel.get_tensor_layout",
        "Layer.__call__ looks up its output's layout on every call, each "
        "key tried as a regex (once per trace on JAX).",
        output_layouts.wrap_get_tensor_layout,
    ),
    Patch(
        KERAS.torch_core,
        "Variable._initialize",
        "Under a distribution a variable holds a DTensor, as on JAX.",
        variables.wrap_initialize,
    ),
    Patch(
        KERAS.torch_core,
        "Variable._initialize_with_initializer",
        "The layout (group, agreed seed) must exist before the draw.",
        variables.wrap_initialize_with_initializer,
    ),
    Patch(
        KERAS.torch_core,
        "Variable._direct_assign",
        "assign/set_weights/load_weights pass global values: laid out.",
        variables.wrap_direct_assign,
    ),
    Patch(
        KERAS.torch_core,
        "convert_to_numpy",
        "Variable.__array__, optimizers: a DTensor is gathered first.",
        variables.wrap_convert_to_numpy,
    ),
    Patch(
        KERAS.torch_ops,
        "convert_to_numpy",
        "Second binding of convert_to_numpy (package re-export; 3.16's "
        "backend.ops: saving and predict).",
        variables.wrap_convert_to_numpy,
    ),
    Patch(
        _BACKEND,
        "convert_to_numpy",
        "Third binding: keras.ops, saving and predict call this one.",
        variables.wrap_convert_to_numpy,
        keras=KERAS_3_15,
    ),
    Patch(
        "keras.src.trainers.data_adapters",
        "get_data_adapter",
        "Keras rejects every input but tf.data in multi-process runs; "
        "here every input yields the global batch and is sliced per rank.",
        data.wrap_get_data_adapter,
    ),
    Patch(
        _TRAINER,
        "TorchEpochIterator._get_iterator",
        "Batches must enter the step as DTensors sharded along the batch "
        "axis (else: 'got mixed torch.Tensor and DTensor').",
        data.wrap_get_iterator,
    ),
    Patch(
        _TRAINER,
        "TorchEpochIterator.__iter__",
        "A checkpoint written mid-epoch (on SIGTERM) must resume at its "
        "batch; Keras starts every epoch at batch 0.",
        data.wrap_epoch_iter,
    ),
    *(
        Patch(
            _TRAINER,
            f"{KERAS.torch_trainer}.make_{kind}_function",
            f"{kind}_on_batch passes the user's arrays straight to the "
            "step; y and sample_weight must be DTensors like y_pred.",
            functools.partial(data.wrap_make_function, kind=kind),
        )
        for kind in ("train", "test", "predict")
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}.get_metrics_result",
        "DataParallel: each rank's metric states cover its entries; logged "
        "values must be the global ones.",
        data_parallel.wrap_get_metrics_result,
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}._compute_loss",
        "DataParallel: compiled metrics are updated with the loss and "
        "summed while backward runs, not in a collective of their own.",
        data_parallel.wrap_compute_loss,
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}.compute_loss",
        "DataParallel: a rank with no entries of a small batch gets a zero "
        "loss, not Keras's empty tensor whose backward raises.",
        data_parallel.wrap_compute_loss_without_rows,
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}.compute_metrics",
        "DataParallel: the compiled metrics of this train step were "
        "already updated with the loss; only their results are read.",
        data_parallel.wrap_compute_metrics,
    ),
    *(
        Patch(
            module,
            f"{cls}._backend_update_step",
            "DataParallel: each rank updates the variables it owns, then they "
            "are broadcast (ZeRO stage 1 on whole variables).",
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
        "A gradient left partial or split along another dim (Dense(1) "
        "under (None, 'model')) is laid out as its variable for the update.",
        variables.wrap_filter_empty_gradients,
    ),
    Patch(
        "keras.src.backend.torch.optimizers.torch_adam",
        "Adam._parallel_update_step",
        "Keras's Adam (and AdamW) holds three temporaries the size of all "
        "weights at once; here it runs on local shards in bounded pieces, "
        "the same arithmetic.",
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
        "Each rank drew a mask for its own entries or shard: one process's "
        "mask is drawn for the global shape, each rank keeps its part.",
        dropout.wrap_dropout,
    ),
    *(
        Patch(
            "keras.src.backend.torch.random",
            name,
            "DataParallel: draws shaped like the batch (GaussianNoise, "
            "augmentation) take this rank's entries of the global draw.",
            data_parallel.wrap_shaped_draw,
        )
        for name in data_parallel.SHAPED_DRAWS
    ),
    Patch(
        "keras.src.layers.normalization.batch_normalization",
        "BatchNormalization.__init__",
        "synchronized=True raised on torch; under DataParallel it means "
        "global-batch statistics (the default unless SYNC_BATCH_NORM=0).",
        data_parallel.wrap_batch_norm_init,
    ),
    Patch(
        KERAS.torch_nn,
        "moments",
        "DataParallel on N processes: the global batch's mean and "
        "variance (one all-reduce), unless SYNC_BATCH_NORM=0.",
        data_parallel.wrap_moments,
    ),
    Patch(
        KERAS.torch_nn,
        "dot_product_attention",
        "3.15's torch rule cannot move the mask; 3.16 drops a Partial or "
        "sequence split silently. It runs on alike-split local shards.",
        attention.wrap_dot_product_attention,
    ),
    Patch(
        _TRAINER,
        f"{KERAS.torch_trainer}.fit",
        "DataParallel's split update lives inside fit; callbacks' file "
        "operations are shared; replicas are compared when it returns.",
        lambda original: fit_guard.wrap_trainer_call(
            replicate_check.wrap_fit(data_parallel.wrap_fit(original))
        ),
    ),
    *(
        Patch(
            _TRAINER,
            f"{KERAS.torch_trainer}.{method}",
            "Callbacks' file operations are shared (rank 0 acts); a failed "
            "collective says a peer died or stalled.",
            fit_guard.wrap_trainer_call,
        )
        for method in ("evaluate", "predict")
    ),
    *(
        Patch(
            "keras.src.utils.file_utils",
            name,
            "Callbacks' directory creation, copies and deletes on shared "
            "paths raised on some rank, then hung: rank 0 acts.",
            functools.partial(shared_files.wrap_file_operation, name=name),
        )
        for name in shared_files.FILE_OPERATIONS
    ),
    Patch(
        "keras.src.callbacks.tensorboard",
        "TensorBoard.set_model",
        "Every rank wrote event files into the shared log_dir; the others "
        "write to a scratch directory.",
        shared_files.wrap_tensorboard_set_model,
    ),
    Patch(
        _TRAINER,
        f"{KERAS.torch_trainer}.{KERAS.should_compile}",
        "torch.compile of the whole train_step fails on DTensor tangents; "
        "the forward is compiled instead.",
        jit.wrap_should_torch_compile,
    ),
    Patch(
        "keras.src.utils.io_utils",
        "print_msg",
        "Progress bars and callback messages print once, from rank 0.",
        callbacks.wrap_print_msg,
    ),
    Patch(
        "keras.src.utils.summary_utils",
        "print_summary",
        "model.summary() prints through a rich console of its own: once.",
        callbacks.wrap_print_summary,
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
        "balancing loss) is computed over the global batch.",
        data_parallel.wrap_add_loss,
    ),
    Patch(
        "keras.src.layers.layer",
        "Layer.__call__",
        "Each call goes to its strategy; model(x) outside fit lays its "
        "inputs out like a fit batch.",
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
        KERAS.torch_numpy,
        "einsum",
        "torch's einsum over DTensors merges a sharded dim for some shapes, "
        "then gathers; the subscripts say the layout, as for mm.",
        model_parallel.wrap_einsum,
    ),
    Patch(
        KERAS.torch_numpy,
        "matmul",
        "A tensor-parallel Dense runs on its local shards, placed by the "
        "einsum rules. Returns at once outside such a call.",
        model_parallel.wrap_matmul,
    ),
    Patch(
        KERAS.torch_numpy,
        "reshape",
        "In a local run, a reshape to a global shape from the config takes "
        "the recorded local one. Returns at once outside such a run.",
        model_parallel.wrap_reshape,
    ),
    Patch(
        KERAS.torch_core,
        "slice_update",
        "With tensor start indices it writes by index_put_, which DTensor "
        "cannot run in place on a sharded tensor (a KV cache in generate).",
        slice_update.wrap_slice_update,
    ),
    *(
        Patch(
            module,
            "distribute_tensor",
            "DataParallel keeps tensors plain; one laid out by hand would meet "
            "plain variables.",
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
            "on JAX (else 'got mixed torch.Tensor and DTensor'); torch's "
            "'numel=1' warning is quieted.",
            context.wrap_set_distribution,
        )
        for module in (
            "keras.src.distribution.distribution_lib",
            "keras.src.distribution",
            "keras.distribution",
        )
    ),
)
