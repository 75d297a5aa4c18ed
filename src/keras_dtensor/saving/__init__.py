"""`.h5` and `.keras` files under a distribution, without a whole copy.

`collective` (rank 0 writes Keras's own file from every rank's shards),
`stores` (sharded values go to `h5_stream` in pieces, on one host through
`shm_blocks`), `zip_writer` (the `.keras` zip in one pass; `crc32`) and
`sliced_load` (each rank reads its slices).
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
