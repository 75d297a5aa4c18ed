"""Redistributions torch 2.13 gets wrong between partial placements."""

from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["wrap_redistribute_backward", "wrap_redistribute_local_tensor"]


def wrap_redistribute_backward(original):
    """Wraps `_redistribute_backward`: sum a plain partial meeting a mask."""

    def _redistribute_backward(grad_output, previous_spec, **kwargs):
        current = tuple(grad_output.placements)
        placements = tuple(
            Replicate() if g.is_partial() and f.is_partial() and g != f else g
            for g, f in zip(current, previous_spec.placements, strict=True)
        )
        if placements != current:  # a plain sum meets another partial
            grad_output = grad_output.redistribute(
                grad_output.device_mesh, placements
            )
        return original(grad_output, previous_spec, **kwargs)

    return _redistribute_backward


def wrap_redistribute_local_tensor(original):
    """Wraps `redistribute_local_tensor`: dims becoming partial go last."""

    def redistribute_local_tensor(
        local_tensor, current_spec, target_spec, **kw
    ):
        current, target = current_spec.placements, target_spec.placements
        # The dims becoming partial stay as they are for a first step.
        placements = tuple(
            c if t.is_partial() and not c.is_partial() else t
            for c, t in zip(current, target, strict=True)
        )
        if placements in (tuple(current), tuple(target)):
            return original(local_tensor, current_spec, target_spec, **kw)
        between = DTensorSpec(
            target_spec.mesh, placements, tensor_meta=current_spec.tensor_meta
        )
        local_tensor = original(local_tensor, current_spec, between, **kw)
        return original(local_tensor, between, target_spec, **kw)

    return redistribute_local_tensor
