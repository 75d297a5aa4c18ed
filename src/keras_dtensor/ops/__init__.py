"""torch-level fixes and kernels over DTensors, installed by the torch and
Keras entries of `keras_dtensor.patches`: `strategies` (sharding rules
DTensor lacks), `redistribute` (between partial placements),
`compile_fixes` (the compile-cache key, views across a graph break),
`embedding_grad` (a vocabulary-sharded embedding's gradient),
`sharded_adam` (Adam on local shards) and `einsum_plan` (an einsum's
layout from its subscripts). Modules here import only `backend`.
"""
