"""Redistributions torch 2.13 gets wrong between partial placements.

Both functions wrap DTensor internals and are installed by the torch entries of
the `PATCHES` table: a masked partial meeting a plain partial gradient in
backward, and indices both gathered and masked in one redistribution.
"""

from torch.distributed.tensor import Replicate

__all__ = ["wrap_redistribute_backward", "wrap_redistribute_local_tensor"]


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
