"""Test setup: the torch backend before Keras is imported; one thread."""

import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
