"""Test setup: the torch backend before Keras is imported; one thread."""

import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's models are far below the size at which DataParallel splits
# the optimizer update by default: split them anyway, so the split is what
# they test (`test_optimizers` checks the default on a small model).
os.environ.setdefault("KERAS_DTENSOR_SPLIT_UPDATE_MB", "0")
sys.path.insert(0, os.path.dirname(__file__))
