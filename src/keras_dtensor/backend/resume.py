"""Starting the next training epoch at a given batch: the checkpoint
callback asks once (`request`), the epoch iterator `take`s it and skips.
"""

import collections
from collections.abc import Callable

__all__ = ["Request", "positionable", "request", "count_epochs_read", "take"]

_KEY = "keras_dtensor_resume_request"
_POSITIONABLE = (
    "ArrayDataAdapter",
    "TorchDataLoaderAdapter",
    "PyDatasetAdapter",
)

Request = collections.namedtuple("Request", ["batches", "done", "epochs_read"])
Request.__doc__ = """Skip `batches` of the next epoch, after `epochs_read`
of its input; `done(skipped, kind)` reports."""


def request(batches: int, done: Callable | None, epochs_read=0) -> None:
    """Asks the next training epoch to start at batch `batches`."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(_KEY, Request(batches, done, epochs_read))


def take() -> Request | None:
    """The pending request (at most once), or `None`."""
    from keras.src.backend.common import global_state

    pending = global_state.get_global_attribute(_KEY)
    if pending is not None:
        global_state.set_global_attribute(_KEY, None)
    return pending


def count_epochs_read(epoch_iterator, epochs_read: int) -> None:
    """Advances the adapter's shuffle-seeding epoch count (Keras 3.16)."""
    adapter = epoch_iterator.data_adapter
    if isinstance(getattr(adapter, "_epoch", None), int):
        adapter._epoch += epochs_read


def positionable(epoch_iterator) -> tuple[bool, str]:
    """`(can it be positioned, the input's kind)` of an epoch iterator."""
    adapter = epoch_iterator.data_adapter
    kind = type(adapter).__name__
    steps = epoch_iterator.steps_per_epoch
    whole_epochs = steps is None or steps == adapter.num_batches
    return kind in _POSITIONABLE and whole_epochs, kind
