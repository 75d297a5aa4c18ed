"""The only code that touches Keras or torch internals: the `PATCHES` table.

Its entries (`patch_kinds`) live in `keras_patches`, `saving_patches`,
`keras_3_16_patches` and `torch_patches`. `apply()` is all or none and
idempotent; `restore()` puts back only what still holds our replacement
(docs/internals/patches.md).
"""

from keras_dtensor.backend import object_state
from keras_dtensor.patches import patch_kinds
from keras_dtensor.patches.keras_3_16_patches import KERAS_3_16_PATCHES
from keras_dtensor.patches.keras_patches import KERAS_PATCHES
from keras_dtensor.patches.saving_patches import SAVING_PATCHES
from keras_dtensor.patches.torch_patches import TORCH_PATCHES

__all__ = ["PATCHES", "apply", "is_applied", "restore", "status"]

PATCHES = KERAS_PATCHES + KERAS_3_16_PATCHES + SAVING_PATCHES + TORCH_PATCHES

# {target: what the entry's apply() saved}
_ORIGINALS = {}


def is_applied() -> bool:
    """Whether the table is currently applied."""
    return bool(_ORIGINALS)


def apply():
    """Applies every entry of `PATCHES` that applies here, once; a
    `RuntimeError` names a missing target before anything is replaced."""
    if not is_applied():
        patch_kinds.apply_all(PATCHES, _ORIGINALS)


def restore():
    """Restores every entry we still own, and attributes set on objects."""
    patch_kinds.restore_all(PATCHES, _ORIGINALS)
    object_state.restore()


def status():
    """`(target, state, why)` per entry; state is `"applied"`, `"original"`,
    `"replaced by another library"` or `"skipped: <reason>"`."""
    return patch_kinds.status_of(PATCHES, _ORIGINALS)
