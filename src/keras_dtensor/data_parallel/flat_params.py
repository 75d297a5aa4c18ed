"""The trainable parameters of a DataParallel model, stored by owner.

After a split optimizer update every owner broadcasts the variables it
updated (`zero_update`). With those parameters laid out as views of one
flat buffer per (owner, dtype), the broadcast goes straight into them: no
concatenation on the owner, no copy back out on the other ranks (FSDP's
flat parameters; DDP's `gradient_as_bucket_view`, for the parameters).

The Parameters keep their identity (Keras's variables, its layers'
`torch_params` and the reducer's gradient hooks all hold them): only their
storage moves, through `Parameter.data`. A parameter whose storage moved
again later is copied into and out of its slot around the broadcast.
"""

import torch

__all__ = ["OwnerBuffers"]


class OwnerBuffers:
    """One flat buffer per (owner, dtype), the parameters views of it.

    Args:
        params: the trainable torch Parameters.
        owners: the rank that updates each of `params` (`zero_update`).
    """

    def __init__(self, params, owners):
        groups = {}
        for param, owner in zip(params, owners, strict=True):
            groups.setdefault((owner, param.dtype), []).append(param)
        self.flat = {}  # (owner, dtype) -> the flat buffer
        # id(param) -> ((owner, dtype), its view of the buffer, param)
        self.slot = {}
        with torch.no_grad():
            for key, group in groups.items():
                device = group[0].device
                if any(p.device != device for p in group):
                    continue
                flat = torch.empty(
                    sum(p.numel() for p in group), dtype=key[1], device=device
                )
                offset = 0
                for param in group:
                    view = flat[offset : offset + param.numel()].view_as(param)
                    view.copy_(param)
                    param.data = view  # frees the old storage
                    offset += param.numel()
                    self.slot[id(param)] = (key, view, param)
                self.flat[key] = flat

    def flat_of(self, key, group):
        """`(buffer, moved)`: the buffer of `key` and the `(tensor, its
        slot)` pairs of the tensors of `group` no longer stored in it, when
        every tensor of `group` is one of its parameters; else `None`.

        The answer depends only on which parameters `group` holds, the
        same on every rank, so every rank sends or receives the same
        buffer. Parameters missing from `group` (no gradient this step)
        hold the same value on every rank: sending them is still exact.
        """
        flat = self.flat.get(key)
        if flat is None:
            return None
        moved = []
        for tensor in group:
            slot = self.slot.get(id(tensor))
            if slot is None or slot[0] != key or slot[2] is not tensor:
                return None
            if not tensor.is_set_to(slot[1]):
                moved.append((tensor, slot[1]))
        return flat, moved

    def release(self):
        """Gives every parameter still in a buffer storage of its own, so
        no buffer outlives the step that built it (a parameter left out of
        the next train function's buffers would keep a whole one alive)."""
        with torch.no_grad():
            for _, view, param in self.slot.values():
                if param.is_set_to(view):
                    param.data = view.clone()
        self.flat.clear()
        self.slot.clear()
