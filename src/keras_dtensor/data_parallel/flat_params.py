"""The trainable parameters of a DataParallel model, stored by owner.

After a split optimizer update every owner broadcasts the variables it
updated (`zero_update`). With those parameters views of one flat buffer
per (owner, dtype) (`ops.flat_buffers`, FSDP's flat parameters), the
broadcast goes straight into them: no copy on either side. The Parameters
keep their identity (Keras's variables, its layers and the reducer's hooks
hold them): only their storage moves, through `Parameter.data`.
"""

import torch

from keras_dtensor.ops.flat_buffers import flat_views

__all__ = ["OwnerBuffers"]


class OwnerBuffers:
    """One flat buffer per (owner, dtype), `params` views of it; `owners`:
    the rank that updates each of them."""

    def __init__(self, params, owners):
        groups = {}
        for param, owner in zip(params, owners, strict=True):
            groups.setdefault((owner, param.dtype), []).append(param)
        self.flat = {}  # (owner, dtype) -> the flat buffer
        self.slot = {}  # id(param) -> ((owner, dtype), its view, param)
        with torch.no_grad():
            for key, group in groups.items():
                if any(p.device != group[0].device for p in group):
                    continue
                self.flat[key], places = flat_views(group)
                for param, view in zip(group, places, strict=True):
                    view.copy_(param)
                    param.data = view  # frees the old storage
                    self.slot[id(param)] = (key, view, param)

    def flat_of(self, key, group):
        """`(buffer, moved)`: the buffer of `key` and the `(tensor, its
        view)` pairs of the tensors of `group` stored elsewhere since,
        when every tensor of `group` is one of its parameters; else `None`.

        The answer depends only on which parameters `group` holds, the
        same on every rank. Parameters missing from `group` (no gradient
        this step) hold the same value on every rank: sending them is
        exact.
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
        no buffer outlives the train function that built it."""
        with torch.no_grad():
            for _, view, param in self.slot.values():
                if param.is_set_to(view):
                    param.data = view.clone()
        self.flat.clear()
        self.slot.clear()
