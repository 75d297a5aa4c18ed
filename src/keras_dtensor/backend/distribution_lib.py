"""Keras backend distribution module for torch, on DTensor: the JAX
module's functions; device `i` is rank `i`, a mesh a cached torch mesh.
"""

import collections

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_dtensor import compat
from keras_dtensor.backend import launch
from keras_dtensor.backend.errors import describe_mesh
from keras_dtensor.backend.layout import to_placements
from keras_dtensor.backend.shards import from_local
from keras_dtensor.backend.shards import shard_global_tensor

__all__ = [
    "DTensorLayout",
    "as_backend_layout",
    "check_layout",
    "distribute_data_input",
    "distribute_tensor",
    "distribute_variable",
    "get_device_count",
    "initialize",
    "initialize_rng",
    "device_ranks",
    "list_devices",
    "num_processes",
    "process_id",
]

_MESH_CACHE = "keras_dtensor_backend_meshes"

DTensorLayout = collections.namedtuple(
    "DTensorLayout", ["device_mesh", "placements"]
)
DTensorLayout.__doc__ = """A Keras `TensorLayout` as a torch mesh (without
the Keras mesh's size-1 axes) and one placement per mesh dimension."""


def list_devices(device_type=None):
    """Return all the available devices: one per process, by global rank."""
    own = "gpu" if launch.device_type() == "cuda" else "cpu"
    kind = device_type.lower() if device_type else own
    if kind not in ("cpu", own):
        raise ValueError(
            f"This process computes on {own!r}; one device per process, so "
            f"there are no {kind!r} devices to list. Received: "
            f"device_type={kind!r}"
        )
    return [f"{kind}:{i}" for i in range(launch.num_processes())]


def get_device_count(device_type=None):
    """Returns the number of devices: one per process."""
    return len(list_devices(device_type))


def initialize(job_addresses, num_processes, process_id):
    """Starts the process group and agrees on one random seed."""
    launch.init_process_group(job_addresses, num_processes, process_id)
    launch.agree_on_seed()


# Keras's names for what `launch` does.
initialize_rng = launch.agree_on_seed
num_processes = launch.num_processes
process_id = launch.process_id


def device_ranks(device_mesh):
    """Global ranks of the mesh's devices, checked without communication."""
    world = launch.num_processes()
    mesh = describe_mesh(device_mesh.shape, device_mesh.axis_names)
    names = [str(d) for d in np.asarray(device_mesh.devices).flatten()]
    ranks = []
    for name in names:
        _, _, index = name.partition(":")
        if not index.isdigit():
            raise ValueError(
                f"Device {name!r} of the {mesh} is not of the form "
                "'cpu:<rank>' or 'gpu:<rank>'."
            )
        ranks.append(int(index))
    if len(ranks) != world or sorted(ranks) != list(range(world)):
        raise ValueError(
            f"The {mesh} has {len(ranks)} devices {names}, but this job "
            f"has {world} processes (one device per process): the mesh "
            f"must hold each of {list_devices()} exactly once."
        )
    return ranks


def _kept_axes(device_mesh):
    """The mesh axes of size > 1 (the first, for one device)."""
    kept = [i for i, n in enumerate(device_mesh.shape) if n > 1]
    return kept or [0]


def _to_backend_mesh(device_mesh):
    """The Keras mesh as a cached torch `DeviceMesh` (a collective to build)."""
    from keras.src.backend.common import global_state

    ranks = device_ranks(device_mesh)
    launch.init_process_group()
    kept = _kept_axes(device_mesh)
    shape = tuple(device_mesh.shape[i] for i in kept)
    names = tuple(device_mesh.axis_names[i] for i in kept)
    key = (shape, names, *ranks)
    cache = global_state.get_global_attribute(
        _MESH_CACHE, {}, set_to_default=True
    )
    if key not in cache:
        cache[key] = DeviceMesh(
            launch.device_type(),
            torch.tensor(ranks, dtype=torch.int64).reshape(shape),
            mesh_dim_names=names,
        )
    return cache[key]


def _to_backend_layout(tensor_layout):
    """Convert the `TensorLayout` to a `DTensorLayout`."""
    if tensor_layout.device_mesh is None:
        raise ValueError(
            "Cannot create sharding when device mesh is not set "
            "for TensorLayout."
        )
    mesh = tensor_layout.device_mesh
    placements = to_placements(tensor_layout.axes, mesh.shape, mesh.axis_names)
    kept = _kept_axes(mesh)
    return DTensorLayout(
        mesh.backend_mesh,
        tuple(
            placements[i] if mesh.shape[i] > 1 else Replicate() for i in kept
        ),
    )


def as_backend_layout(layout, path=None, shape=None):
    """The `DTensorLayout` of `layout`, checked against `shape` if given."""
    from keras.src.distribution import TensorLayout

    if path is not None or shape is not None:
        check_layout(layout, shape, path)
    if isinstance(layout, TensorLayout):
        return layout.backend_layout
    if isinstance(layout, DTensorLayout):
        return layout
    raise ValueError(
        "Expected a `keras.distribution.TensorLayout` or a `DTensorLayout`. "
        f"Received: layout={layout!r}"
    )


def distribute_tensor(tensor, layout):
    """Distribute the tensor based on the layout (a `DTensor`: redistribute)."""
    if isinstance(tensor, DTensor):
        layout = as_backend_layout(layout)
        target = (layout.device_mesh, tuple(layout.placements))
        if (tensor.device_mesh, tuple(tensor.placements)) == target:
            return tensor
        return tensor.redistribute(layout.device_mesh, layout.placements)
    tensor = _as_tensor(tensor)
    if launch.num_processes() == 1:
        check_layout(layout, tuple(tensor.shape))
        return tensor
    layout = as_backend_layout(layout, shape=tuple(tensor.shape))
    return shard_global_tensor(tensor, layout)


def _as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    return compat.torch_core().convert_to_tensor(x)


def check_layout(layout, shape, path=None):
    """Raises for `layout` what `as_backend_layout` would, with no mesh."""
    from keras.src.distribution import TensorLayout

    if isinstance(layout, TensorLayout) and layout.device_mesh is not None:
        mesh = layout.device_mesh
        to_placements(
            layout.axes, mesh.shape, mesh.axis_names, path=path, shape=shape
        )
    elif not isinstance(layout, (TensorLayout, DTensorLayout)):
        as_backend_layout(layout)


def distribute_variable(value, layout):
    """Create a distributed variable value for the layout."""
    return torch.nn.Parameter(distribute_tensor(value, layout))


def distribute_data_input(per_process_batch, layout, batch_dim_name):
    """Distribute the input data: this process's slice of the global batch."""
    if isinstance(per_process_batch, DTensor) or launch.num_processes() == 1:
        return distribute_tensor(per_process_batch, layout)
    per_process_batch = _as_tensor(per_process_batch)
    layout = as_backend_layout(layout)
    mesh = layout.device_mesh
    parts = 1
    for size, placement in zip(mesh.shape, layout.placements, strict=True):
        if placement.is_shard():
            parts *= size
    shape = list(per_process_batch.shape)
    if shape:
        shape[0] *= parts
    return from_local(per_process_batch, mesh, layout.placements, shape)
