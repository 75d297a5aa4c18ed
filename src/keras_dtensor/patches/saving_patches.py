"""The Keras entries of the `PATCHES` table that save and load weights."""

import functools

from keras_dtensor import saving
from keras_dtensor.compat import KERAS
from keras_dtensor.patches.patch_kinds import Patch

__all__ = ["SAVING_PATCHES"]

SAVING_PATCHES = (
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__getitem__",
        "The store hands out the dataset, read lazily, not whole values.",
        saving.wrap_h5_store_getitem,
    ),
    Patch(
        KERAS.torch_core,
        "Variable._convert_to_tensor",
        "A sharded variable reads only its slices of a lazy dataset.",
        saving.wrap_convert_variable_value,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "save_weights_only",
        "Every rank takes part in a save; only rank 0 writes, atomically.",
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
        "A store opened for writing elsewhere is written as save_weights.",
        saving.wrap_h5_store_init,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.close",
        "Rank 0 puts such a store's file in place; failures raise on all.",
        saving.wrap_h5_store_close,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "H5IOStore.__setitem__",
        "Inside a save rank 0 writes a sharded variable in pieces.",
        saving.wrap_h5_store_setitem,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "ShardedH5IOStore.__setitem__",
        "max_shard_size sizes its files from shapes, not gathered values.",
        saving.wrap_sharded_h5_store_setitem,
    ),
    Patch(
        "keras.src.optimizers.base_optimizer",
        "BaseOptimizer.save_own_variables",
        "Inside a save the store gets the slot variable, not a gather.",
        saving.wrap_optimizer_save_own_variables,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "_save_model_to_fileobj",
        "model.save writes the weights file in place in the zip, once.",
        saving.wrap_save_model_to_fileobj,
    ),
)
