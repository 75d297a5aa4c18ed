"""The lowest layer: Keras's `distribution_lib` contract on DTensor, and
what every other part asks.

- `distribution_lib`: the module Keras leaves empty for torch (the names
  and signatures of `keras/src/backend/jax/distribution_lib.py`);
- `layout`: pure layout arithmetic (axes to placements, shard sizes and
  offsets), no process group;
- `batch_layout`: arrays of a batch to batch-sharded DTensors; `shards`:
  a rank's shard of a global value, as a DTensor;
- `launch`: the process group's lifecycle, world and rank, collectives of
  small values; `consensus`: one rank's failure raised on every rank;
- `context`: the current distribution and its scopes; `console`: which
  rank prints; `errors`: messages naming the path, the axes and the mesh;
- `files`: staged saves moved into place; `placement_order`: sharding
  choices equal on every rank; `object_state`: attributes set on single
  Keras objects, taken off by `uninstall()`; `fast_tree`: Keras's tree
  functions, fast for a layer call's usual arguments; `resume`: the next
  epoch started at a given batch.

Modules here import only each other, `config` and `compat`.
"""
