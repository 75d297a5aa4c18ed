"""Starting the next training epoch at a given batch (a one-shot request).

A checkpoint written in the middle of an epoch (on a termination signal)
resumes at its exact batch when the input can be positioned: the epoch's
shuffle is drawn again from what it was drawn from, and the batches already
trained are read and dropped. Keras 3.15 draws an epoch's shuffle from the
global generators (restored by the checkpoint callback); Keras 3.16 seeds
it with the number of epochs its data adapter has read (`_epoch`), which a
resumed `fit` starts afresh, so the request carries the number of epochs
the uninterrupted run had read and the epoch iterator adds it
(`count_epochs_read`). The checkpoint callback asks for that (`request`)
when the resumed epoch begins; the epoch iterator takes the request when it
starts (`take`), skips the batches if its input can be positioned, and
reports back through `done(positioned)`.

Positionable: numpy arrays and tensors, a torch `DataLoader` (its sampler
draws from torch's generator), a `PyDataset` (Python's `random`), each
read from its start every epoch. Not positionable: tf.data, generators,
and any input read across epochs (`steps_per_epoch` shorter than the
data); there the epoch restarts from its first batch.
"""

import dataclasses
from collections.abc import Callable

__all__ = ["Request", "positionable", "request", "count_epochs_read", "take"]

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
        epochs_read: how many epochs of the input the uninterrupted run
            had read before this one.
    """

    batches: int
    done: Callable[[bool, str], None] | None
    epochs_read: int = 0


def _state():
    # Imported when used: `import keras_dtensor` checks the environment
    # before anything loads Keras.
    from keras.src.backend.common import global_state

    return global_state


def request(
    batches: int,
    done: Callable[[bool, str], None] | None,
    epochs_read: int = 0,
) -> None:
    """Asks the next training epoch to start at batch `batches`, as the
    `epochs_read + 1`-th epoch of its input."""
    _state().set_global_attribute(_KEY, Request(batches, done, epochs_read))


def take() -> Request | None:
    """The pending request (at most once), or `None`."""
    global_state = _state()
    pending = global_state.get_global_attribute(_KEY)
    if pending is not None:
        global_state.set_global_attribute(_KEY, None)
    return pending


def count_epochs_read(epoch_iterator, epochs_read: int) -> None:
    """Adds `epochs_read` to the data adapter's epoch count where it seeds
    the shuffle (Keras 3.16's array and `PyDataset` adapters), so the
    resumed `fit`'s first epoch is drawn as the uninterrupted run's was."""
    adapter = epoch_iterator.data_adapter
    if isinstance(getattr(adapter, "_epoch", None), int):
        adapter._epoch += epochs_read


def positionable(epoch_iterator) -> tuple[bool, str]:
    """`(can it be positioned, the input's kind)` for a Keras epoch
    iterator."""
    adapter = epoch_iterator.data_adapter
    kind = type(adapter).__name__
    steps = epoch_iterator.steps_per_epoch
    whole_epochs = steps is None or steps == adapter.num_batches
    return kind in _POSITIONABLE and whole_epochs, kind
