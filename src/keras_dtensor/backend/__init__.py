"""The lowest layer: Keras's `distribution_lib` contract on DTensor, and
what every part asks: `layout`, `batch_layout`, `shards`, `launch`,
`consensus`, `context`, `console`, `errors`, `files`, `placement_order`,
`object_state`, `fast_tree`, `resume`. Imports only `config`, `compat`.
"""
