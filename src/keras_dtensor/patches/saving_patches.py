"""The Keras entries of the `PATCHES` table that save and load weights."""

import functools

from keras_dtensor import saving
from keras_dtensor.compat import KERAS
from keras_dtensor.patches.patch_kinds import Patch

__all__ = ["SAVING_PATCHES"]


_TORCH_CORE = KERAS.torch_core
SAVING_PATCHES = (
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__getitem__",
        "Loads read every variable whole on every rank; here the store "
        "hands out the dataset, read lazily.",
        saving.wrap_h5_store_getitem,
    ),
    Patch(
        _TORCH_CORE,
        "Variable._convert_to_tensor",
        "A sharded variable assigned from the lazy dataset reads only this "
        "rank's slices of it (sliced_load.py).",
        saving.wrap_convert_variable_value,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_weights_only",
        "Every rank must take part (shards travel to rank 0); only rank 0 "
        "may write (h5py's lock), atomically.",
        functools.partial(saving.wrap_save, what="save_weights"),
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_model",
        "model.save: as save_weights_only.",
        functools.partial(saving.wrap_save, what="save"),
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__init__",
        "A store opened for writing elsewhere (save_lora_weights) was "
        "opened by every rank; it is written as save_weights writes.",
        saving.wrap_h5_store_init,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.close",
        "Puts such a store's file in place (rank 0) and raises any rank's "
        "failure on every rank.",
        saving.wrap_h5_store_close,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__setitem__",
        "A sharded variable was gathered whole on every rank; inside a "
        "save rank 0 writes it in pieces from its owners.",
        saving.wrap_h5_store_setitem,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "ShardedH5IOStore.__setitem__",
        "max_shard_size gathered every variable to size its files; a "
        "sharded value passes as shape and dtype, written in pieces.",
        saving.wrap_sharded_h5_store_setitem,
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer.save_own_variables",
        "It stores variable.numpy(), a whole gather of every sharded slot "
        "on every rank; inside a save the store gets the variable.",
        saving.wrap_optimizer_save_own_variables,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "_save_model_to_fileobj",
        "model.save built the weights file in memory or wrote it twice; "
        "h5py writes it in place in the zip.",
        saving.wrap_save_model_to_fileobj,
    ),
)
