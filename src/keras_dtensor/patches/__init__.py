"""The only code that touches Keras or torch internals: the `PATCHES` table.

Two kinds of rows (`rows`):

- `Patch`: one attribute of Keras or torch (`module`, dotted
  `attribute`), why it is replaced, the Keras and torch versions it
  applies to, and a factory that builds the replacement from the
  original.
- `Registration`: a DTensor sharding strategy registered for torch ops
  (through the public `register_sharding`), with the rule it replaces
  saved.

Tables: `keras_rows` and `saving_rows` (Keras), `keras_3_16_rows` (Keras
3.16's own torch distribution stood down), `torch_rows` (torch).

`apply()` skips the rows outside the installed versions, resolves every
other row's target before touching anything, applies all or none, is
idempotent, and tags every replacement; `restore()` puts back only what
still holds our replacement (someone else's later wrapper is left alone,
with a warning), then takes off the attributes hooks set on single
objects (`backend.object_state`), so `keras_dtensor.uninstall()` leaves Keras
and torch as they were.
"""

from keras_dtensor.backend import object_state
from keras_dtensor.patches import rows
from keras_dtensor.patches.keras_3_16_rows import KERAS_3_16_ROWS
from keras_dtensor.patches.keras_rows import KERAS_ROWS
from keras_dtensor.patches.rows import CacheKey
from keras_dtensor.patches.rows import Patch
from keras_dtensor.patches.rows import Registration
from keras_dtensor.patches.saving_rows import SAVING_ROWS
from keras_dtensor.patches.torch_rows import TORCH_ROWS

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

PATCHES = KERAS_ROWS + KERAS_3_16_ROWS + SAVING_ROWS + TORCH_ROWS

# Saved originals: {target: what the row's apply() returned}.
_ORIGINALS = {}


def is_applied() -> bool:
    """Whether the table is currently applied."""
    return bool(_ORIGINALS)


def apply():
    """Applies every row of `PATCHES`, once.

    Raises:
        RuntimeError: the installed Keras or torch is outside a row's
            range (checked for all rows before anything is replaced).
    """
    if not is_applied():
        rows.apply_rows(PATCHES, _ORIGINALS)


def restore():
    """Restores the originals of every row we still own, and the attributes
    set on single objects."""
    rows.restore_rows(PATCHES, _ORIGINALS)
    object_state.restore()


def status():
    """One row per patch: `(target, state, why)`; state is `"applied"`,
    `"original"` or `"replaced by another library"`."""
    return rows.row_status(PATCHES, _ORIGINALS)
