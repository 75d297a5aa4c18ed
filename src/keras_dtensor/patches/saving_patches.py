"""The Keras entries of the `PATCHES` table that save and load weights.

Each entry names its target, why it is replaced and the Keras versions it was
checked against; `keras_dtensor.patches` applies and restores them.
"""

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
        "load_weights/load_model read every variable whole on every rank: "
        "a model that fits only sharded could not be loaded. Under a "
        "distribution the store hands out the dataset, read lazily.",
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
        "A store opened for writing outside save_weights/model.save "
        "(keras_hub's save_lora_weights) was opened by every rank: h5py's "
        "lock failed on all but one, whose gathers then hung; under a "
        "distribution it is written as save_weights writes.",
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
        "Converting a sharded variable to numpy gathered it whole on every "
        "rank (2x the model per rank while saving); inside a save rank 0 "
        "writes it in pieces from the shards' owners (h5_stream.py).",
        saving.wrap_h5_store_setitem,
    ),
    Patch(
        "keras.src.saving.saving_lib",
        "ShardedH5IOStore.__setitem__",
        "save_weights(max_shard_size=...) converted every variable to "
        "numpy first (a whole gather) to size its shard files; inside a "
        "save a sharded value passes as its shape and dtype and is "
        "written in pieces (stores.py).",
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
        "model.save built the whole weights file in memory on rank 0 (a "
        "BytesIO, then a copy), or in a temporary file copied into the "
        "zip (written twice); inside a save h5py writes it in place in "
        "the zip (zip_writer.py).",
        saving.wrap_save_model_to_fileobj,
    ),
)
