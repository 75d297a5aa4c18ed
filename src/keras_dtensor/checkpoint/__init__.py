"""Sharded checkpoints on `torch.distributed.checkpoint` (DCP).

The entry points (`api`): `save_checkpoint`, `load_checkpoint`,
`latest_checkpoint`, `export_weights`, `import_weights`;
`ShardedCheckpoint` (`callback`) saves during `fit` and resumes. They are
served by the manifest and its checksums (`manifest`), the writer
(`writer`), the reader (`reader`) and termination signals
(`preemption`). Imported on first use: `import keras_dtensor` does not
load DCP.
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
