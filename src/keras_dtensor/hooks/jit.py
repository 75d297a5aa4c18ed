"""`jit_compile=True` under a distribution: a compiled forward, the rest
eager; after a failure or at dynamo's recompile limit, eager on every rank."""

import collections
import warnings

import torch

from keras_dtensor import config
from keras_dtensor.backend import console
from keras_dtensor.backend import context
from keras_dtensor.backend import fast_tree
from keras_dtensor.backend import launch
from keras_dtensor.backend import object_state

__all__ = ["wrap_should_torch_compile"]


def _signature(args, kwargs):
    key = []
    for x in fast_tree.flatten((args, kwargs)):
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype))
        else:
            key.append(x if isinstance(x, (bool, int, float, str)) else 0)
    return tuple(key)


def _warn(message):
    if not console.silent():
        warnings.warn(message, stacklevel=3)


class _Forward:
    """A model's compiled forward, eager once every rank agrees to."""

    def __init__(self, model):
        self._name = model.name
        self._state = lambda: model.non_trainable_variables
        self._eager = model.call
        self._compiled = torch.compile(model.call, dynamic=False)
        self._calls = collections.Counter()  # by signature
        self._most = 0  # the most compilations of one of its functions
        self._all_eager = False  # agreed by every rank
        self.error = None  # this rank's failed trial
        self.recompiles = None  # the count that made every rank eager

    def __call__(self, *args, **kwargs):
        if self._all_eager or torch.compiler.is_compiling():
            # (Inside another compiled region: traced by that one.)
            return self._eager(*args, **kwargs)
        key = _signature(args, kwargs)
        # Registered per call: `torch._dynamo.reset()` clears callbacks.
        handler = torch._dynamo.callback_handler
        handler.register_start_callback(self._started)
        try:
            outputs = self._run(key, args, kwargs)
        finally:
            handler.remove_start_callback(self._started)
        # Global batch shapes: every rank agrees at the same calls.
        self._calls[key] += 1
        count = self._calls[key]
        if count & (count - 1) == 0:
            self._agree()
        return outputs

    def _started(self, args):
        """Dynamo's count of a function's compilations, kept in `_most`."""
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger != CallbackTrigger.DYNAMO:
            return
        parts = str(args.compile_id).split("/")
        if parts[0].startswith("!"):  # compiled autograd: "!0/frame/n"
            parts = parts[1:]
        if len(parts) == 2 and parts[1].isdigit():
            self._most = max(self._most, int(parts[1]) + 1)

    def _run(self, key, args, kwargs):
        if self.error is not None:
            return self._eager(*args, **kwargs)
        if self._calls[key]:  # its trial ran
            return self._compiled(*args, **kwargs)
        saved = [(v, v.value.detach().clone()) for v in self._state()]
        try:
            outputs = self._compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the eager rerun re-raises
            self.error = e
            # Its message on one line, without Keras's ANSI bold.
            text = str(e).replace("\x1b[1m", "").replace("\x1b[0m", "")
            text = " ".join(text.split())[:300]
            with torch.no_grad():
                for variable, value in saved:
                    variable.value.copy_(value)
            _warn(
                f"jit_compile=True: torch.compile could not run the "
                f"forward of model {self._name!r} over DTensors "
                f"({type(e).__name__}: {text}); it runs eagerly."
            )
            return self._eager(*args, **kwargs)
        return outputs

    def _agree(self):
        mine = [self._most, int(self.error is not None)]
        rows = launch.all_gather_int_lists(mine)
        most, failed = (max(column) for column in zip(*rows, strict=True))
        if not failed and most < torch._dynamo.config.recompile_limit:
            return
        self._all_eager = True
        if failed:
            if self.error is None:  # this rank warned if its own failed
                _warn(
                    f"jit_compile=True: torch.compile could not run the "
                    f"forward of model {self._name!r} on another process; "
                    f"it runs eagerly on every process."
                )
            return
        self.recompiles = most
        _warn(
            f"jit_compile=True: torch.compile compiled a function of the "
            f"forward of model {self._name!r} {most} times, "
            f"torch._dynamo.config.recompile_limit (once per layer where "
            f"a graph break splits the forward into each layer's calls, "
            f"and again for each new input shape); it runs eagerly from "
            f"now on, on every process (TORCH_LOGS=recompiles says why)."
        )


def _compile_forward(model):
    if object_state.get_on(model, "call") is None:
        object_state.set_on(model, "call", _Forward(model))


def wrap_should_torch_compile(original):
    """Wraps `_should_torch_compile` (3.16: `_use_torch_compile`)."""

    def _should_torch_compile(self):
        if context.current() is None:
            return original(self)
        if not self.jit_compile or self.run_eagerly:
            return False
        distribution = context.active()
        if distribution is None or context.is_data_parallel(distribution):
            return True  # plain tensors: Keras's own whole-step compile
        if config.get("JIT"):
            _compile_forward(self)
        return False

    return _should_torch_compile
