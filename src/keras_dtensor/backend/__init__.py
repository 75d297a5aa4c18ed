"""The lowest layer: Keras's `distribution_lib` contract on DTensor, and
what every other part asks: `layout` (pure layout arithmetic),
`batch_layout` and `shards` (global values to DTensors), `launch` (the
process group, small collectives), `consensus`, `context` (the current
distribution), `console`, `errors`, `files`, `placement_order`,
`object_state`, `fast_tree`, `resume`. Modules here import only each
other, `config` and `compat`.
"""
