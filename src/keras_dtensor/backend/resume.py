"""Starting the next training epoch at a given batch (a one-shot request).

A checkpoint written in the middle of an epoch (on a termination signal)
resumes at its exact batch when the input can be positioned: the epoch's
shuffle is drawn again from the random state it was drawn from, and the
batches already trained are read and dropped. The checkpoint callback asks
for that (`request`) when the resumed epoch begins; the epoch iterator
takes the request when it starts (`take`), skips the batches if its input
can be positioned, and reports back through `done(positioned)`.

Positionable: numpy arrays and tensors, a torch `DataLoader` (its sampler
draws from torch's generator), a `PyDataset` (Python's `random`), each
read from its start every epoch. Not positionable: tf.data, generators,
and any input read across epochs (`steps_per_epoch` shorter than the
data); there the epoch restarts from its first batch.
"""

import dataclasses
from collections.abc import Callable

__all__ = ["Request", "positionable", "request", "take"]

_KEY = "keras_dtensor_resume_request"
_POSITIONABLE = (
    "ArrayDataAdapter",
    "TorchDataLoaderAdapter",
    "PyDatasetAdapter",
)


@dataclasses.dataclass
class Request:
    """Skip the first `batches` of the next training epoch.

    Attributes:
        batches: how many batches were trained in the epoch already.
        done: called with whether they were skipped (the input could be
            positioned) once the epoch iterator has started.
    """

    batches: int
    done: Callable[[bool, str], None]


def _state():
    # Imported when used: `import keras_dtensor` checks the environment
    # before anything loads Keras.
    from keras.src.backend.common import global_state

    return global_state


def request(batches: int, done: Callable[[bool, str], None]) -> None:
    """Asks the next training epoch to start at batch `batches`."""
    _state().set_global_attribute(_KEY, Request(batches, done))


def take() -> Request | None:
    """The pending request (at most once), or `None`."""
    global_state = _state()
    pending = global_state.get_global_attribute(_KEY)
    if pending is not None:
        global_state.set_global_attribute(_KEY, None)
    return pending


def positionable(epoch_iterator) -> tuple[bool, str]:
    """`(can it be positioned, the input's kind)` for a Keras epoch
    iterator."""
    adapter = epoch_iterator.data_adapter
    kind = type(adapter).__name__
    steps = epoch_iterator.steps_per_epoch
    whole_epochs = steps is None or steps == adapter.num_batches
    return kind in _POSITIONABLE and whole_epochs, kind
