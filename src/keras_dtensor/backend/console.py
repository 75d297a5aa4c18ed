"""Which rank speaks: rank 0, or all with `KERAS_DTENSOR_LOG_ALL_RANKS=1`."""

import torch.distributed as dist

from keras_dtensor import config
from keras_dtensor.backend.launch import multi_process

__all__ = ["silent"]


def silent() -> bool:
    """Whether this rank keeps quiet (all but rank 0)."""
    return (
        multi_process()
        and dist.get_rank() != 0
        and not config.get("LOG_ALL_RANKS")
    )
