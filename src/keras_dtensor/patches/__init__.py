"""The only code that touches Keras or torch internals: the `PATCHES` table.

Two kinds of entries (`patch_kinds`):

- `Patch`: one attribute of Keras or torch (`module`, dotted
  `attribute`), why it is replaced, the Keras and torch versions it
  applies to, and a factory that builds the replacement from the
  original.
- `Registration`: a DTensor sharding strategy registered for torch ops
  (through the public `register_sharding`), with the rule it replaces
  saved.

Tables: `keras_patches` and `saving_patches` (Keras),
`keras_3_16_patches` (Keras 3.16's own torch distribution stood down),
`torch_patches` (torch).

`apply()` skips the entries outside the installed versions, resolves every
other entry's target before touching anything, applies all or none, is
idempotent, and tags every replacement; `restore()` puts back only what
still holds our replacement (someone else's later wrapper is left alone,
with a warning), then takes off the attributes hooks set on single
objects (`backend.object_state`), so `keras_dtensor.uninstall()` leaves Keras
and torch as they were.
"""

from keras_dtensor.backend import object_state
from keras_dtensor.patches import patch_kinds
from keras_dtensor.patches.keras_3_16_patches import KERAS_3_16_PATCHES
from keras_dtensor.patches.keras_patches import KERAS_PATCHES
from keras_dtensor.patches.patch_kinds import CacheKey
from keras_dtensor.patches.patch_kinds import Patch
from keras_dtensor.patches.patch_kinds import Registration
from keras_dtensor.patches.saving_patches import SAVING_PATCHES
from keras_dtensor.patches.torch_patches import TORCH_PATCHES

__all__ = [
    "PATCHES",
    "CacheKey",
    "Patch",
    "Registration",
    "apply",
    "is_applied",
    "restore",
    "status",
]

PATCHES = KERAS_PATCHES + KERAS_3_16_PATCHES + SAVING_PATCHES + TORCH_PATCHES

# Saved originals: {target: what the entry's apply() returned}.
_ORIGINALS = {}


def is_applied() -> bool:
    """Whether the table is currently applied."""
    return bool(_ORIGINALS)


def apply():
    """Applies every entry of `PATCHES`, once.

    Raises:
        RuntimeError: the installed Keras or torch is outside an entry's
            range (checked for all entries before anything is replaced).
    """
    if not is_applied():
        patch_kinds.apply_all(PATCHES, _ORIGINALS)


def restore():
    """Restores the originals of every entry we still own, and the attributes
    set on single objects."""
    patch_kinds.restore_all(PATCHES, _ORIGINALS)
    object_state.restore()


def status():
    """One entry per patch: `(target, state, why)`; state is `"applied"`,
    `"original"` or `"replaced by another library"`."""
    return patch_kinds.status_of(PATCHES, _ORIGINALS)
