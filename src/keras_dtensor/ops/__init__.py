"""torch-level fixes and kernels over DTensors, installed by the torch and
Keras entries of `keras_dtensor.patches`: `strategies` (sharding rules
DTensor lacks), `redistribute` (between partial placements),
`compile_fixes` (the compile-cache key, views across a graph break),
`embedding_grad` (a vocabulary-sharded embedding's gradient),
`sharded_adam` (Adam on local shards) and `einsum_plan` (an einsum's
layout from its subscripts). `flat_buffers` is the one bucketing and
flat-buffer packer: DataParallel's gradient buckets and owners'
buffers, the local run's packed gathers and partial-sum reduction.
Modules here import only `backend`.
"""
