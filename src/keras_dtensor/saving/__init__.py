"""`.h5` and `.keras` files under a distribution, without a whole copy.

Keras's own writers and readers run on every rank, through the hooks of
the `PATCHES` table: `collective` (`save_weights`, `model.save`: rank 0
writes the file from every rank's shards, staged and renamed into place;
a failure on any rank raises on every rank), `stores` (Keras's weight
stores hand sharded values to `h5_stream`, which writes them in pieces
from the ranks holding them, assembled in shared memory on one host by
`shm_blocks`), `zip_writer` (the `.keras` zip in one pass, its records in
`zip_format`, its CRC-32 joined by `crc32`) and `sliced_load` (each rank
reads only its slices). The files are ordinary Keras files.
"""

from keras_dtensor.saving.collective import wrap_save
from keras_dtensor.saving.collective import wrap_save_model_to_fileobj
from keras_dtensor.saving.sliced_load import wrap_convert_variable_value
from keras_dtensor.saving.sliced_load import wrap_h5_store_getitem
from keras_dtensor.saving.stores import Deferred
from keras_dtensor.saving.stores import deferring
from keras_dtensor.saving.stores import wrap_h5_store_close
from keras_dtensor.saving.stores import wrap_h5_store_init
from keras_dtensor.saving.stores import wrap_h5_store_setitem
from keras_dtensor.saving.stores import wrap_optimizer_save_own_variables
from keras_dtensor.saving.stores import wrap_sharded_h5_store_setitem

__all__ = [
    "Deferred",
    "deferring",
    "wrap_convert_variable_value",
    "wrap_h5_store_close",
    "wrap_h5_store_getitem",
    "wrap_h5_store_init",
    "wrap_h5_store_setitem",
    "wrap_optimizer_save_own_variables",
    "wrap_save",
    "wrap_save_model_to_fileobj",
    "wrap_sharded_h5_store_setitem",
]
