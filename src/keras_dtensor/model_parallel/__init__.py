"""ModelParallel the DTensor way: layouts from a `LayoutMap`, run locally
where they allow it.

`local_run` (the one entry of a layer call) runs a model on local tensors
where `local_run_spec` allows: batch-sharded weights gathered by block
(`fsdp_blocks`, `packed_gather`), read locally (`local_grads`);
tensor-parallel layers as DTensor islands (`boundary_layers`) or on their
shards (`local_split`, `local_shards`), checked against the recorded
DTensor run (`reference_run`, `local_run_check`, `reshapes`). See
docs/internals/local-run.md.
"""

from keras_dtensor.model_parallel.local_grads import reduce_partial_grads
from keras_dtensor.model_parallel.local_run import active as in_local_run
from keras_dtensor.model_parallel.local_run import call_layer
from keras_dtensor.model_parallel.local_run_spec import variables_changed
from keras_dtensor.model_parallel.local_shards import wrap_einsum
from keras_dtensor.model_parallel.local_shards import wrap_matmul
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
