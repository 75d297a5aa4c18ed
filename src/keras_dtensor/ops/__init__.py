"""torch-level fixes and kernels over DTensors, installed by
`keras_dtensor.patches`: `strategies`, `redistribute`, `compile_fixes`,
`embedding_grad`, `sharded_adam`, `einsum_plan` and `flat_buffers` (the
one packer). Modules here import only `backend`.
"""
