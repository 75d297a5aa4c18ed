"""ModelParallel the DTensor way: layouts from a `LayoutMap`, run locally
where they allow it.

Every layer call goes through `call_layer` (`call`). A model with
FSDP-style layouts runs on this rank's rows as plain tensors (`local_run`,
decided by `local_run_spec`), its batch-sharded weights gathered block by
block (`fsdp_blocks`, `packed_gather`), each weight read locally
(`local_grads`). Its tensor-parallel layers are DTensor islands
(`boundary_layers`) or run on their local shards (`local_split`,
`local_shards`, `einsum`), checked once against the DTensor run as it ran
(`reference_run`, `local_run_check`); reshapes to global shapes take their
local shape from that run (`reshapes`). Anything else runs on DTensors,
batch-sharded weights gathered by their layer (`fsdp_weights`). Partial-sum
gradients are reduced together before the optimizer (`partial_grads`).
See docs/internals/local-run.md.
"""

from keras_dtensor.model_parallel.call import call_layer
from keras_dtensor.model_parallel.einsum import wrap_einsum
from keras_dtensor.model_parallel.einsum import wrap_matmul
from keras_dtensor.model_parallel.local_run import active as in_local_run
from keras_dtensor.model_parallel.local_run_spec import variables_changed
from keras_dtensor.model_parallel.partial_grads import reduce_partial_grads
from keras_dtensor.model_parallel.reference_run import recorder
from keras_dtensor.model_parallel.reshapes import local_cache
from keras_dtensor.model_parallel.reshapes import wrap_reshape

__all__ = [
    "call_layer",
    "in_local_run",
    "local_cache",
    "recorder",
    "recording",
    "reduce_partial_grads",
    "variables_changed",
    "wrap_einsum",
    "wrap_matmul",
    "wrap_reshape",
]


def recording() -> bool:
    """Whether a DTensor run is being recorded to check a local run."""
    return recorder() is not None
