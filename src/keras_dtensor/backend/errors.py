"""Message builders: every error names the tensor path, axes and the mesh."""

import re

__all__ = [
    "AssignedInCall",
    "collective_failure",
    "describe_mesh",
    "local_output_error",
]


def describe_mesh(mesh_shape, axis_names) -> str:
    """Returns `mesh shape (2, 2), axis_names ('batch', 'model')`."""
    return f"mesh shape {tuple(mesh_shape)}, axis_names {tuple(axis_names)}"


# Fragments of torch.distributed's own messages when a peer is gone.
_PEER_FAILURE = re.compile(
    "gloo|nccl|connection (reset|closed)|broken pipe|timed out|timeout|"
    "collective mismatch|received data size"
)


def collective_failure(error, *, operation, rank, world, timeout):
    """A `RuntimeError` for a collective a peer broke, else `None`."""
    message = str(error)
    if not _PEER_FAILURE.search(message.lower()):
        return None
    first_line = message.strip().splitlines()[0][:300]
    return RuntimeError(
        f"{operation} on rank {rank} of {world} stopped: a collective with "
        "the other processes failed. Another process died, stalled or ran "
        "different code: its log (torchrun prints which rank failed first) "
        "has the cause. Collectives wait at most "
        f"{timeout:g} s (KERAS_DTENSOR_TIMEOUT). torch said: {first_line}"
    )


def local_output_error(*, layer, shape, rows, rank, mesh) -> ValueError:
    """A model run on this rank's rows returned a non-batch output."""
    return ValueError(
        f"Model `{layer}` ran on rank {rank}'s {rows} rows of the batch "
        f"({describe_mesh(mesh.shape, mesh.mesh_dim_names)}) and returned "
        f"an output of shape {tuple(shape)} whose first dimension is not "
        "the batch, so it cannot be laid out over the batch axis. To run "
        "this model as DTensors, set KERAS_DTENSOR_LOCAL_BATCH=0."
    )


class AssignedInCall(Exception):  # noqa: N818 (a signal, not an error)
    """A local call would assign a variable: it runs again as DTensors."""
