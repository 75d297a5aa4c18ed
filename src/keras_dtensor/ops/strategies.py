"""DTensor fixes that distributed Keras programs need from torch 2.13.

Only the functions live here; the `PATCHES` table (`patches.py`) installs
them, shows them in `keras-dtensor info` and takes them off again.

1. Sharding choices that agree across ranks are in `placement_order.py`.

2. Sharding strategies for ops DTensor lacks, registered through the
   public experimental `register_sharding`; they only affect ops whose
   inputs are DTensors.

CPU flash attention (`torch.nn.functional.scaled_dot_product_attention` on
CPU, which Keras's `MultiHeadAttention` calls) has no strategy in torch
2.13, so head-parallel attention crashes in backward. Attention is
independent per batch row and per head: with q/k/v/out all sharded on the
batch dimension (0) or the head dimension (1), the op runs on local
shards, exactly like the single-device op on a slice.

Sampling from a batch-sharded DTensor (`torch.multinomial`, which
`keras.random.categorical` and keras_hub's top-k/top-p/random samplers
call) runs, by torch's rule, on each rank's rows with the caller's
generator: every rank draws from the start of the same stream, so rows
past the first shard get other samples than one process gives them. Here
the op is replicated: the probabilities are gathered (batch x classes)
and every rank draws the whole sample from the same generator state, the
one-process result.

Comparison ops (`eq`, `ne`, `lt`, ... on tensors and scalars) have
strategies from torch 2.13 on; torch 2.11 lacks some (`aten.ne.Tensor`,
which Keras's optimizer EMA runs on its replicated `iterations`). Where torch
has none, an elementwise one is registered: all replicated, or every input
sharded like the output when the shapes match (no broadcasting over a
sharded dim). Ops torch already covers are left alone.
"""

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = [
    "elementwise",
    "flash_cpu",
    "flash_cpu_backward",
    "flash_cpu_backward_ops",
    "flash_cpu_ops",
    "keep_kwargs_in_place",
    "missing_comparisons",
    "register_elementwise",
    "replicated_sample",
    "sample_ops",
    "wrap_redistribute_backward",
    "wrap_slice_update",
    "wrap_redistribute_local_tensor",
]

_aten = torch.ops.aten


def _per_row_or_head(num_outputs, num_tensors, num_scalars, attn_mask):
    """Strategies: all replicated, or all sharded on dim 0 or dim 1."""
    strategies = []
    for placement in (Replicate(), Shard(0), Shard(1)):
        if attn_mask is not None and isinstance(placement, Shard):
            # A mask broadcast along the sharded dim stays replicated.
            mask = placement if attn_mask.shape[placement.dim] > 1 else None
            mask = mask or Replicate()
        else:
            mask = None if attn_mask is None else Replicate()
        outputs = [placement] * num_outputs
        inputs = [placement] * num_tensors + [None] * num_scalars + [mask]
        strategies.append((outputs, inputs))
    return strategies


def flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, **kwargs):
    # -> (output, logsumexp); inputs q, k, v; scalars dropout_p, is_causal.
    return _per_row_or_head(2, 3, 2, kwargs.get("attn_mask"))


def flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, **kw
):
    # -> (grad_q, grad_k, grad_v); inputs grad_out, q, k, v, out, lse.
    return _per_row_or_head(3, 6, 2, kw.get("attn_mask"))


def elementwise(self, other=None, **kwargs):
    # -> one output; inputs self and, for `.Tensor` overloads, other.
    tensors = [self] + ([other] if hasattr(other, "shape") else [])
    scalars = 0 if len(tensors) == 2 else 1
    strategies = [
        ([Replicate()], [Replicate()] * len(tensors) + [None] * scalars)
    ]
    if all(tuple(t.shape) == tuple(self.shape) for t in tensors):
        for dim in range(len(self.shape)):
            shard = Shard(dim)
            strategies.append(
                ([shard], [shard] * len(tensors) + [None] * scalars)
            )
    return strategies


def replicated_sample(self, num_samples, replacement=False, **kwargs):
    # -> one output; input self; scalars num_samples, replacement.
    return [([Replicate()], [Replicate(), None, None])]


def sample_ops():
    """The sampling op whose per-shard draws differ from one process's."""
    return [_aten.multinomial.default]


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _has_strategy(op):
    """Whether torch's DTensor has a sharding rule of its own for `op`."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = (
        "op_strategy_funcs",
        "op_single_dim_strategy_funcs",
        "op_to_rules",
    )
    return any(op in getattr(propagator, table, {}) for table in tables)


def missing_comparisons():
    """The comparison overloads torch's DTensor has no strategy for."""
    ops = []
    for name in _COMPARISONS:
        for overload in ("Tensor", "Scalar"):
            op = getattr(getattr(_aten, name), overload)
            if not _has_strategy(op):
                ops.append(op)
    return ops


def _mixed_partial(grad_placements, forward_placements):
    """Mesh dims where a plain sum meets a different partial type."""
    return [
        i
        for i, (grad, forward) in enumerate(
            zip(grad_placements, forward_placements, strict=True)
        )
        if grad.is_partial() and forward.is_partial() and grad != forward
    ]


def wrap_redistribute_backward(original):
    """Wraps DTensor's `_redistribute_backward(grad, previous_spec, ...)`.

    Backward of a redistribution brings the gradient back to the forward
    input's placements. When the forward input was a masked partial sum
    (a vocabulary-sharded embedding lookup) and the gradient arrives as a
    plain partial sum (from a column-parallel layer downstream), DTensor
    has no rule from one partial type to the other and raises. The
    gradient of a partial tensor is its full value, so the gradient is
    summed (Partial -> Replicate) first; DTensor then keeps it replicated,
    as it does for every replicated gradient of a partial input.
    """

    def _redistribute_backward(grad_output, previous_spec, **kwargs):
        dims = _mixed_partial(grad_output.placements, previous_spec.placements)
        if dims:
            placements = [
                Replicate() if i in dims else p
                for i, p in enumerate(grad_output.placements)
            ]
            grad_output = grad_output.redistribute(
                grad_output.device_mesh, placements
            )
        return original(grad_output, previous_spec, **kwargs)

    return _redistribute_backward


def wrap_redistribute_local_tensor(original):
    """Wraps the `redistribute_local_tensor` DTensor's dispatcher calls.

    An embedding's indices that must become a masked partial on one mesh
    dimension (the vocabulary-sharded table) and be gathered on another
    (a batch-sharded input meeting a table sharded on its feature axis
    over the batch axis, as keras_hub's Gemma layout does on a 2 x 2
    mesh) get their mask recorded before the gather, for this rank's rows
    only; the partial sum is then masked with the wrong rows ("The shape
    of the mask [2, 8] ... does not match ... [4, 8, 8]"). Here the other
    dimensions are redistributed first, then the partial ones.
    """

    def redistribute_local_tensor(
        local_tensor, current_spec, target_spec, **kw
    ):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        current, target = current_spec.placements, target_spec.placements
        partial = [
            i
            for i, (c, t) in enumerate(zip(current, target, strict=True))
            if t.is_partial() and not c.is_partial()
        ]
        others = [
            i
            for i, (c, t) in enumerate(zip(current, target, strict=True))
            if c != t and i not in partial
        ]
        if not partial or not others:
            return original(local_tensor, current_spec, target_spec, **kw)
        between = DTensorSpec(
            target_spec.mesh,
            tuple(
                c if i in partial else t
                for i, (c, t) in enumerate(zip(current, target, strict=True))
            ),
            tensor_meta=current_spec.tensor_meta,
        )
        local_tensor = original(local_tensor, current_spec, between, **kw)
        return original(local_tensor, between, target_spec, **kw)

    return redistribute_local_tensor


def _aligned(inputs, start_indices, updates):
    """`(inputs, updates)` with each replicated one cut like the other on
    every mesh dim where the update spans a whole dim the other shards
    (and every rank gets part of it): a local cut, no communication.

    A KV cache made by `ops.zeros` (replicated) filled with head-sharded
    keys takes their split, instead of gathering the keys onto every rank;
    a cache split by heads updated with a replicated key takes its rank's
    part of the key. A single key/value head on two ranks stays whole on
    each (as Megatron and vLLM replicate key/value heads when there are
    fewer than ranks).
    """
    from torch.distributed.tensor import DTensor

    if not (
        isinstance(inputs, DTensor)
        and isinstance(updates, DTensor)
        and inputs.device_mesh == updates.device_mesh
        and inputs.ndim == updates.ndim
    ):
        return inputs, updates
    mesh = inputs.device_mesh
    cut = [list(inputs.placements), list(updates.placements)]
    pairs = zip(inputs.placements, updates.placements, strict=True)
    for i, pair in enumerate(pairs):
        for to, source in ((0, pair[1]), (1, pair[0])):
            if not (pair[to].is_replicate() and type(source) is Shard):
                continue
            dim = source.dim
            if (
                start_indices[dim] == 0
                and inputs.shape[dim] == updates.shape[dim]
                and inputs.shape[dim] >= mesh.size(i)  # no rank left empty
                and Shard(dim) not in cut[to]
            ):
                cut[to][i] = Shard(dim)
    if cut[0] != list(inputs.placements):
        inputs = inputs.redistribute(mesh, cut[0])
    if cut[1] != list(updates.placements):
        updates = updates.redistribute(mesh, cut[1])
    return inputs, updates


def wrap_slice_update(original):
    """Wraps Keras's torch `slice_update(inputs, start_indices, updates)`.

    With tensor start indices Keras writes through advanced indexing
    (`index_put_` with index grids), which DTensor cannot run in place on
    a sharded tensor ("in-place operations that require placement changes
    are not supported"): a KV cache sharded by batch or heads, updated at
    the decoding position. For DTensors the start indices are read as
    Python ints, Keras's own basic-slicing path, which DTensor runs on
    each shard.

    A replicated `inputs` updated along a whole dim that `updates` shards
    takes the update's layout, and the other way round (`_aligned`):
    keras_hub builds its KV cache with `ops.zeros`, a replicated value,
    and fills it with the head-sharded keys and values; as torch's tensor
    parallelism keeps each rank's heads' cache, each rank then holds its
    heads only, and no update is gathered.
    """

    def slice_update(inputs, start_indices, updates):
        from torch.distributed.tensor import DTensor

        if isinstance(inputs, DTensor) or isinstance(updates, DTensor):
            start_indices = [int(i) for i in start_indices]
            inputs, updates = _aligned(inputs, start_indices, updates)
        return original(inputs, start_indices, updates)

    return slice_update


def keep_kwargs_in_place(strategy, op_schema):
    """Drops the strategies that would move a tensor keyword argument.

    DTensor redistributes an op's positional tensors to the chosen
    strategy, never its keyword tensors (the attention mask of CPU flash
    attention): a strategy that needs the mask elsewhere would run the
    local op on mismatched shapes ("shape '[1, 1, 8, 8]' is invalid").
    Only strategies that leave every keyword tensor where it is are kept.
    """
    current = [
        tuple(s.strategies[0].output_spec.placements)
        for s in op_schema.kwargs_strategy
    ]
    if not current:
        return strategy
    kept = [
        spec
        for spec in strategy.strategies
        if [
            tuple(s.placements)
            for s in spec.input_specs[-len(current) :]
            if s is not None
        ]
        == current
    ]
    if kept:
        strategy.strategies = kept
    return strategy


def flash_cpu_ops():
    """The CPU flash-attention forward op."""
    return [_aten._scaled_dot_product_flash_attention_for_cpu.default]


def flash_cpu_backward_ops():
    """The CPU flash-attention backward op."""
    return [_aten._scaled_dot_product_flash_attention_for_cpu_backward.default]


def register_elementwise(ops):
    """Gives each op in `ops` the elementwise strategy, outside the table.

    For tests only: they pass ops torch already covers, to run the fallback
    on a torch that needs none (in a process of their own).
    """
    for op in ops:
        register_sharding(op)(elementwise)
