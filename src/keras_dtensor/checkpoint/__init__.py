"""Sharded checkpoints on `torch.distributed.checkpoint` (DCP).

Every rank writes its own shards; any number of processes, under any
layout, loads them back. The entry points (`api`): `save_checkpoint`,
`load_checkpoint`, `latest_checkpoint`, `export_weights`,
`import_weights`; `ShardedCheckpoint` (`callback`) saves during `fit` and
resumes from the newest. The files and their manifest (`manifest`), the
writer that hashes as it writes (`writer`, with the checksums of
`digest`) and the reader that unpickles nothing but DCP's metadata
(`reader`) serve them; `position` records where a run is inside an epoch,
and `preemption` turns a termination signal on any rank into a
checkpoint on all. Imported on first use:
`import keras_dtensor` does not load DCP.
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
