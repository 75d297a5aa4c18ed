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


_BACKEND = "keras.src.backend"
_TRAINER = "keras.src.backend.torch.trainer"
# Every module that binds keras.distribution's public functions.
_DISTRIBUTION = (
    "keras.src.distribution.distribution_lib",
    "keras.src.distribution",
    "keras.distribution",
)
KERAS_PATCHES = (
    Patch(
        _BACKEND,
        "distribution_lib",
        "None for torch in Keras; every keras.distribution call uses it.",
        lambda original: distribution_lib,
    ),
    Patch(
        "keras.src.distribution.distribution_lib",
        "distribution_lib",
        "keras.distribution binds the backend module a second time, at import.",
        lambda original: distribution_lib,
    ),
    Patch(
        "keras.src.distribution.distribution_lib",
        "ModelParallel.get_tensor_layout",
        "Layer.__call__ looks its output layout up by regex on every call.",
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
        "Second binding of convert_to_numpy (3.16: saving and predict).",
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
        "Keras takes only tf.data in multi-process runs; any input works here.",
        data.wrap_get_data_adapter,
    ),
    Patch(
        _TRAINER,
        "TorchEpochIterator._get_iterator",
        "Batches enter the step as DTensors sharded along the batch axis.",
        data.wrap_get_iterator,
    ),
    Patch(
        _TRAINER,
        "TorchEpochIterator.__iter__",
        "A checkpoint written mid-epoch resumes at its batch, not batch 0.",
        data.wrap_epoch_iter,
    ),
    *(
        Patch(
            _TRAINER,
            f"{KERAS.torch_trainer}.make_{kind}_function",
            f"{kind}_on_batch: y and sample_weight are laid out like y_pred.",
            functools.partial(data.wrap_make_function, kind=kind),
        )
        for kind in ("train", "test", "predict")
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}.get_metrics_result",
        "DataParallel: logged metrics are the global values, not one rank's.",
        data_parallel.wrap_get_metrics_result,
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}._compute_loss",
        "DataParallel: compiled metrics are summed while backward runs.",
        data_parallel.wrap_compute_loss,
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}.compute_loss",
        "DataParallel: a rank with no entries of the batch gets a zero loss.",
        data_parallel.wrap_compute_loss_without_rows,
    ),
    Patch(
        "keras.src.trainers.trainer",
        f"{KERAS.base_trainer}.compute_metrics",
        "DataParallel: compiled metrics were updated with the loss already.",
        data_parallel.wrap_compute_metrics,
    ),
    *(
        Patch(
            module,
            f"{cls}._backend_update_step",
            "DataParallel: ZeRO-1, each rank updates the variables it owns.",
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
        "A partial or differently split gradient is laid out as its variable.",
        variables.wrap_filter_empty_gradients,
    ),
    Patch(
        "keras.src.backend.torch.optimizers.torch_adam",
        "Adam._parallel_update_step",
        "Adam runs on local shards in bounded pieces, the same arithmetic.",
        sharded_adam.wrap_adam_update,
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer.add_variable_from_reference",
        "A split update's slot must know its variable to be brought back.",
        data_parallel.wrap_add_variable_from_reference,
    ),
    Patch(
        "keras.src.backend.torch.random",
        "dropout",
        "One mask is drawn for the global shape; each rank keeps its part.",
        dropout.wrap_dropout,
    ),
    *(
        Patch(
            "keras.src.backend.torch.random",
            name,
            "DataParallel: a batch-shaped draw takes this rank's entries.",
            data_parallel.wrap_shaped_draw,
        )
        for name in data_parallel.SHAPED_DRAWS
    ),
    Patch(
        "keras.src.layers.normalization.batch_normalization",
        "BatchNormalization.__init__",
        "synchronized=True raised on torch; here: global-batch statistics.",
        data_parallel.wrap_batch_norm_init,
    ),
    Patch(
        KERAS.torch_nn,
        "moments",
        "DataParallel: the global batch's mean and variance (one all-reduce).",
        data_parallel.wrap_moments,
    ),
    Patch(
        KERAS.torch_nn,
        "dot_product_attention",
        "Sharded attention runs on alike-split local shards, mask included.",
        attention.wrap_dot_product_attention,
    ),
    Patch(
        _TRAINER,
        f"{KERAS.torch_trainer}.fit",
        "DataParallel's split update, shared file operations, replica check.",
        lambda original: fit_guard.wrap_trainer_call(
            replicate_check.wrap_fit(data_parallel.wrap_fit(original))
        ),
    ),
    *(
        Patch(
            _TRAINER,
            f"{KERAS.torch_trainer}.{method}",
            "Callbacks' file operations are shared; a peer's failure is named.",
            fit_guard.wrap_trainer_call,
        )
        for method in ("evaluate", "predict")
    ),
    *(
        Patch(
            "keras.src.utils.file_utils",
            name,
            "Callbacks' file operations on shared paths: rank 0 acts.",
            functools.partial(shared_files.wrap_file_operation, name=name),
        )
        for name in shared_files.FILE_OPERATIONS
    ),
    Patch(
        "keras.src.callbacks.tensorboard",
        "TensorBoard.set_model",
        "Only rank 0 writes event files into the shared log_dir.",
        shared_files.wrap_tensorboard_set_model,
    ),
    Patch(
        _TRAINER,
        f"{KERAS.torch_trainer}.{KERAS.should_compile}",
        "torch.compile fails on the whole train_step: the forward is compiled.",
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
        "Batch-end callbacks stay on the main thread: collectives in order.",
        callbacks.wrap_configure_async_dispatch,
    ),
    Patch(
        "keras.src.layers.layer",
        "Layer.add_loss",
        "DataParallel: a layer's added loss is computed over the global batch.",
        data_parallel.wrap_add_loss,
    ),
    Patch(
        "keras.src.layers.layer",
        "Layer.__call__",
        "Each call goes to its strategy; model(x) lays inputs out as fit does.",
        layer_call.wrap_call,
    ),
    Patch(
        "keras.src.random.seed_generator",
        "SeedGenerator.next",
        "The state is a replicated DTensor, the increment a plain tensor.",
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
        "index_put_ cannot write in place into a sharded DTensor (KV cache).",
        slice_update.wrap_slice_update,
    ),
    *(
        Patch(
            module,
            "distribute_tensor",
            "DataParallel keeps tensors plain, even ones laid out by hand.",
            data_parallel.wrap_distribute_tensor,
        )
        for module in _DISTRIBUTION
    ),
    *(
        Patch(
            module,
            "set_distribution",
            "Plain tensors are global values while a distribution is set.",
            context.wrap_set_distribution,
        )
        for module in _DISTRIBUTION
    ),
)
