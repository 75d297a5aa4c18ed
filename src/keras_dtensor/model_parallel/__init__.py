"""ModelParallel the DTensor way: layouts from a `LayoutMap`, run locally
where they allow it.

Variables are DTensors laid out by the distribution. A layer call goes
through `call_layer` (`call`), the one entry:

- a model whose weights are replicated or sharded over the batch axis only
  (FSDP-style layouts) runs on this rank's rows as plain tensors, its
  batch-sharded weights gathered block by block (`local_run`,
  `local_run_spec`, `fsdp_blocks`, `packed_gather`), each weight read as
  its local tensor (`local_grads`);
- a tensor-parallel layer inside such a run is a DTensor island
  (`boundary_layers`), or runs on its local shards (`local_split`,
  `local_shards`, `einsum`), checked once against the DTensor run as it
  ran (`reference_run`, `local_run_check`); a reshape to a global shape
  in the model's own code takes its local shape from that run
  (`reshapes`);
- everything else runs on DTensors, weights sharded over the batch axis
  gathered by the layer that uses them (`fsdp_weights`), partial sums
  reduced at each layer's boundary;
- gradients that arrive as partial sums are reduced together before the
  optimizer (`partial_grads`).

The variable hooks ask `in_local_run()` and `recording()` before an
assignment and call `variables_changed()` when a variable is created.
"""

from keras_dtensor.model_parallel.call import call_layer
from keras_dtensor.model_parallel.einsum import wrap_einsum
from keras_dtensor.model_parallel.einsum import wrap_matmul
from keras_dtensor.model_parallel.local_run import active as in_local_run
from keras_dtensor.model_parallel.local_run_spec import variables_changed
from keras_dtensor.model_parallel.partial_grads import reduce_partial_grads
from keras_dtensor.model_parallel.reference_run import recorder
from keras_dtensor.model_parallel.reshapes import local_cache
from keras_dtensor.model_parallel.reshapes import local_reshape
from keras_dtensor.model_parallel.reshapes import wrap_reshape

__all__ = [
    "call_layer",
    "in_local_run",
    "local_cache",
    "local_reshape",
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
