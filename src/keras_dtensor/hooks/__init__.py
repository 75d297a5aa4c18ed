"""Keras-side wrappers every strategy shares (`PATCHES` names them):
`variables`, `sharded_init` (variables); `data`, `loader_shards` (the
global batch); `layer_call`, `dropout`, `attention`, `slice_update`,
`output_layouts` (calls and ops); `fit_guard`, `replicate_check`,
`malloc_trim`, `callbacks`, `shared_files` (around `fit`); `jit` (the
forward compiled); `keras_torch_distribution` (Keras 3.16's own stood
down). Design notes: docs/internals/hooks.md."""
