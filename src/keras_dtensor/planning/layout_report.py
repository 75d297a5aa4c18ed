"""What `auto_layout` decided, as a table and a LayoutMap."""

import collections
import dataclasses

__all__ = ["AutoLayout", "Entry"]


# One weight: its layout axes and why.
Entry = collections.namedtuple("Entry", "path shape axes why")


@dataclasses.dataclass
class AutoLayout:
    """What `auto_layout` decided: `entries` per weight, collectives per
    training step, and the `layout_map`."""

    entries: list
    mesh: object
    model_axis: str
    batch_axis: str
    all_reduces_forward: int
    all_reduces_backward: int
    all_gathers_forward: int
    layout_map: object
    bytes_full: int
    bytes_per_rank: int

    def table(self) -> str:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape, strict=True))
        rows = [
            f"| {e.path} | {e.shape} | {e.axes} | {e.why} |"
            for e in self.entries
        ]
        lines = [
            f"auto layout over {self.model_axis!r} ({sizes[self.model_axis]} "
            f"ranks) of mesh {dict(sizes)}",
            "| weight | shape | axes | why |",
            "|---|---|---|---|",
            *rows,
            "collectives per training step (model axis): "
            f"{self.all_reduces_forward} all-reduces forward, "
            f"{self.all_reduces_backward} backward, "
            f"{self.all_gathers_forward} all-gathers forward",
            f"weights per rank: {self.bytes_per_rank / 2**20:.2f} MiB of "
            f"{self.bytes_full / 2**20:.2f} MiB",
        ]
        return "\n".join(lines)

    __str__ = table
