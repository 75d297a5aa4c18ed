"""One step's host work, counted: Python calls (the package's own too),
DTensors built and Python-visible host syncs; exact on any machine.

Calls are counted by `sys.setprofile` in the calling thread (on CUDA,
autograd's device threads are not seen); DTensors by a counting
`DTensor.__new__` (a builtin no profiler event shows).
"""

import sys

# Tensor methods that wait for computed values to reach the host.
_SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy"})


class StepCounts:
    def __init__(self):
        self.calls = self.package_calls = self.dtensors = self.syncs = 0

    def _hook(self, frame, event, arg):
        if event == "call":
            self.calls += 1
            code = frame.f_code
            if "keras_dtensor" in code.co_filename:
                self.package_calls += 1
        elif event == "c_call":
            if getattr(arg, "__name__", "") in _SYNC_METHODS:
                self.syncs += 1

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        self._new = DTensor.__dict__["__new__"]
        new = self._new

        def counted(cls, *args, **kwargs):
            self.dtensors += 1
            return new(cls, *args, **kwargs)

        DTensor.__new__ = staticmethod(counted)
        self._previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        sys.setprofile(self._previous)
        DTensor.__new__ = self._new

    def as_dict(self):
        return {
            "python_calls": self.calls,
            "package_calls": self.package_calls,
            "dtensors": self.dtensors,
            "python_syncs": self.syncs,
        }
