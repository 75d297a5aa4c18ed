"""Keras-side wrappers every strategy shares (`PATCHES` names them).

`variables` and `sharded_init` lay variables out; `data` and
`loader_shards` bring in the global batch; `layer_call`, `dropout`,
`attention`, `slice_update` and `output_layouts` adapt calls and ops;
`fit_guard`, `replicate_check`, `malloc_trim`, `callbacks` and
`shared_files` surround `fit`; `jit` compiles the forward;
`keras_torch_distribution` stands down Keras 3.16's own. Design notes:
docs/internals/hooks.md."""
