"""torch-level fixes and kernels over DTensors.

- `strategies`: sharding strategies for ops DTensor lacks (registered);
- `redistribute`: redistributions between partial placements;
- `compile_fixes`: the compile-cache key and views across a graph break;
- `einsum`: `einsum` on local shards, laid out by its subscripts;
- `embedding_grad`: a vocabulary-sharded embedding's gradient, this rank's
  rows only;
- `sharded_adam`: Adam's update on local shards, in bounded pieces;
- `local_shards`: contractions of local shards, their collectives
  explicit; `einsum_plan`: an einsum's layout from its subscripts;
  `local_grads`: a DTensor weight read as its local tensor, its gradient
  laid out once.

The torch and Keras rows of `keras_dtensor.patches` install them; modules
here import only `backend`.
"""
