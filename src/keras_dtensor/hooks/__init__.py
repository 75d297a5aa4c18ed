"""Keras-side wrappers every strategy shares (`PATCHES` names them).

Variables are DTensors by layout (`variables`), drawn shard by shard
(`sharded_init`); inputs become the global batch (`data`), checked equal
on every rank (`input_checks`), loaded 1/N per process where the input
allows (`loader_shards`, `pydataset_shards`); `layer_call` hands each
layer call to its strategy; `dropout`, `attention`, `slice_update` and
`output_layouts` adapt single ops; `fit_guard`, `replicate_check` and
`malloc_trim` surround `fit`/`evaluate`/`predict`; `callbacks` and
`shared_files` run callbacks on N processes; `jit` compiles the forward;
`keras_torch_distribution` stands down Keras 3.16's own. Design notes:
docs/internals/hooks.md.
"""
