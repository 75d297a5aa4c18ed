"""Keras-side wrappers that sit above the strategies (`PATCHES` names them).

A wrapper that belongs to one mechanism lives with it (the DataParallel
step in `data_parallel`, the stores in `saving`); here are the ones that
serve every strategy:


- `variables`, `sharded_init`: variables are DTensors laid out by the
  distribution, initialized shard by shard;
- `data`, `input_checks`: inputs become the global batch, checked equal on
  every rank; `loader_shards`: a map-style DataLoader loads only this
  process's shard of it; `pydataset_shards`: a `PyDataset`'s batches are
  built 1/N per process and their rows scattered; `dropout`: one
  process's mask on split activations; `layer_call`: each layer call
  handed to its strategy (`data_parallel` or `model_parallel`);
  `slice_update`: a KV cache updated on shards;
- `fit_guard`, `replicate_check`, `malloc_trim`: around
  `fit`/`evaluate`/`predict`;
- `attention`: `dot_product_attention` on DTensor inputs;
  `output_layouts`: output layout lookups by path, remembered per distribution;
- `keras_torch_distribution`: Keras 3.16's own torch distribution, stood
  down where keras-dtensor acts;
- `callbacks`, `shared_files`: callbacks and their file operations on N
  processes; `jit`: `jit_compile=True` as a compiled forward.

Hooks sit above the strategies, saving and checkpoints; nothing below
imports them.
"""
