"""Sharded checkpoints on `torch.distributed.checkpoint` (DCP).

The functions (`api`) and `ShardedCheckpoint` (`callback`), served by
`manifest`, `writer`, `reader` and `preemption` (termination signals).
Imported on first use: `import keras_dtensor` does not load DCP.
"""

from keras_dtensor.checkpoint.api import PendingCheckpoint
from keras_dtensor.checkpoint.api import export_weights
from keras_dtensor.checkpoint.api import import_weights
from keras_dtensor.checkpoint.api import latest_checkpoint
from keras_dtensor.checkpoint.api import load_checkpoint
from keras_dtensor.checkpoint.api import save_checkpoint
from keras_dtensor.checkpoint.callback import ShardedCheckpoint
from keras_dtensor.checkpoint.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PendingCheckpoint",
    "ShardedCheckpoint",
    "export_weights",
    "import_weights",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
