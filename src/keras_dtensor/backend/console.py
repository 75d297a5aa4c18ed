"""Which rank speaks: messages, warnings and progress bars from one rank.

Logged values are global and the same on every rank, so every other rank's
copy is dropped; `KERAS_DTENSOR_LOG_ALL_RANKS=1` prints on every rank.
"""

import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor.backend.launch import multi_process

__all__ = ["silent"]


def silent() -> bool:
    """Whether this rank keeps quiet (all but rank 0, unless
    `KERAS_DTENSOR_LOG_ALL_RANKS=1`)."""
    return (
        multi_process()
        and dist.get_rank() != 0
        and not config.get("LOG_ALL_RANKS")
    )
