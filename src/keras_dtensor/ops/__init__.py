"""torch-level fixes and kernels over DTensors, installed by
`keras_dtensor.patches`: `strategies` (sharding rules DTensor lacks),
`redistribute` (between partial placements), `compile_fixes`,
`embedding_grad` (a vocabulary-sharded embedding's gradient),
`sharded_adam`, `einsum_plan` (an einsum's layout from its subscripts) and
`flat_buffers` (the one bucketing and flat-buffer packer). Modules here
import only `backend`.
"""
