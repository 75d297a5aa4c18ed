"""`fit`/`evaluate`/`predict` on N processes: shared files, named faults."""

import functools

from keras_dtensor import config
from keras_dtensor.backend import consensus
from keras_dtensor.backend import context
from keras_dtensor.backend import errors
from keras_dtensor.backend import launch

__all__ = ["wrap_trainer_call"]


def wrap_trainer_call(original):
    """Wraps `TorchTrainer.fit`, `.evaluate` or `.predict`."""

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        if (
            consensus.files_are_shared()
            or context.current() is None
            or not launch.multi_process()
        ):
            return original(self, *args, **kwargs)
        try:
            with consensus.files_shared():
                return original(self, *args, **kwargs)
        except RuntimeError as e:
            world, rank = launch.world()
            clearer = errors.collective_failure(
                e,
                operation=original.__name__,
                rank=rank,
                world=world,
                timeout=config.get("TIMEOUT"),
            )
            if clearer is None:
                raise
            raise clearer from e

    return call
