"""torch-level fixes and kernels over DTensors.

- `strategies`: sharding strategies for ops DTensor lacks (registered);
- `redistribute`: redistributions between partial placements;
- `compile_fixes`: the compile-cache key and views across a graph break;
- `embedding_grad`: a vocabulary-sharded embedding's gradient, this rank's
  rows only;
- `sharded_adam`: Adam's update on local shards, in bounded pieces;
- `einsum_plan`: an einsum's layout from its subscripts.

The local run's own pieces (`einsum`, `local_shards`, `local_grads`) live
in `model_parallel`.

The torch and Keras entries of `keras_dtensor.patches` install them; modules
here import only `backend`.
"""
