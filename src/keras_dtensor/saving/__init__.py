"""`.h5` and `.keras` files under a distribution, without a whole copy.

Keras's own writers and readers run on every rank, through the hooks the
`PATCHES` table installs:

- `wrap_save` (`collective`): `save_weights` and `model.save` on several
  processes; rank 0 writes the file from every rank's shards, staged and
  renamed into place, and a failure on any rank is raised on every rank;
- `wrap_save_model_to_fileobj` (`collective`, `zip_writer`): the `.keras`
  zip written in one pass, the weights member filled in place;
- the store hooks (`stores`): each sharded variable written in pieces by
  the ranks holding its shards (`h5_stream`; on one host, assembled in
  shared memory: `shm_blocks`), never gathered; a store opened for
  writing outside those functions (keras_hub's `save_lora_weights`)
  written as they write;
- the load hooks (`sliced_load`): each rank reads only its slices of a
  sharded variable;
- the `.keras` zip's records (`zip_format`) and the CRC-32 of a member
  written in pieces (`crc32`).

Files are ordinary Keras files: plain single-process Keras loads them.
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
