"""Layouts checked and costed before anything is allocated.

- `plan` (`memory`): per-rank memory of a distribution's layouts, on `meta`;
- `warn_unmatched_layout_keys` (`lint`): LayoutMap keys no weight matches;
- `lora_layout` (`lora`): a LoRA factor's layout, from its base weight's;
- `auto_layout_map`, `auto_layout` (`auto_layout`): a LayoutMap from the
  model's dataflow (`trace`, `dataflow`, `propagate`), reported as a table.
"""

from keras_dtensor.planning.auto_layout import AutoLayout
from keras_dtensor.planning.auto_layout import auto_layout
from keras_dtensor.planning.auto_layout import auto_layout_map
from keras_dtensor.planning.lint import warn_unmatched_layout_keys
from keras_dtensor.planning.lora import lora_layout
from keras_dtensor.planning.memory import MemoryPlan
from keras_dtensor.planning.memory import VariablePlan
from keras_dtensor.planning.memory import plan

__all__ = [
    "AutoLayout",
    "MemoryPlan",
    "VariablePlan",
    "auto_layout",
    "auto_layout_map",
    "lora_layout",
    "plan",
    "warn_unmatched_layout_keys",
]
