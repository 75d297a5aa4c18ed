"""The backend module on real gloo groups of 1, 2 and 4 processes.

Each rank function runs many checks in one spawn and returns what it saw;
the assertions run in the parent, against values computed there.
"""

import numpy as np
import pytest
from harness import run_ranks
from torch.distributed.tensor import Replicate

pytestmark = pytest.mark.multiprocess


def _expect_value_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _backend_checks():
    import keras
    import torch
    from keras.src.utils import rng_utils
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    from keras_dtensor.backend import distribution_lib
    from keras_dtensor.backend import shards

    world = keras.distribution.get_device_count()
    out = {
        "devices": keras.distribution.list_devices(),
        "count": world,
        "num_processes": distribution_lib.num_processes(),
        "process_id": distribution_lib.process_id(),
        # initialize() agreed on one seed although none was set.
        "seed": rng_utils.get_random_seed(),
    }
    mesh = keras.distribution.DeviceMesh((world,), ["model"])
    torch_mesh = mesh.backend_mesh
    out["mesh"] = (tuple(torch_mesh.shape), torch_mesh.mesh_dim_names)
    out["mesh_ranks"] = torch_mesh.mesh.flatten().tolist()
    # Built once: an equal Keras mesh reuses the torch mesh (no new groups).
    again = keras.distribution.DeviceMesh((world,), ["model"]).backend_mesh
    out["mesh_cached"] = again is torch_mesh

    glob = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    layout = keras.distribution.TensorLayout((None, "model"), mesh)
    sharded = keras.distribution.distribute_tensor(glob, layout)
    # One process computes on plain tensors: the global value itself.
    out["plain"] = not isinstance(sharded, DTensor)
    if out["plain"]:
        sharded = DTensor.from_local(sharded, torch_mesh, [Replicate()])
    out["placements"] = tuple(sharded.placements)
    out["local"] = sharded.to_local().numpy()
    out["full_equal"] = bool(torch.equal(sharded.full_tensor(), glob))
    out["same_returned"] = (
        keras.distribution.distribute_tensor(sharded, layout) is sharded
    )
    row_layout = keras.distribution.TensorLayout(("model", None), mesh)
    moved = keras.distribution.distribute_tensor(sharded, row_layout)
    out["redistributed"] = (
        tuple(moved.placements),
        bool(torch.equal(moved.full_tensor(), glob)),
    )
    # Differentiable: a plain leaf gets gradients through the shard.
    leaf = glob.clone().requires_grad_(True)
    (keras.distribution.distribute_tensor(leaf, layout) * 2).sum().backward()
    out["grad"] = leaf.grad.numpy()

    # Bad layouts: ValueError on every rank, before any communication.
    axes_twice = keras.distribution.TensorLayout(("model", "model"), mesh)
    out["err_twice"] = _expect_value_error(
        lambda: keras.distribution.distribute_tensor(glob, axes_twice)
    )
    too_many = keras.distribution.TensorLayout((None, None, "model"), mesh)
    out["err_rank"] = _expect_value_error(
        lambda: distribution_lib.as_backend_layout(
            too_many, path="x/kernel", shape=(6, 8)
        )
    )
    # Size-1 axes are left out of the torch mesh: replication there.
    mesh_2d = keras.distribution.DeviceMesh((1, world), ["batch", "model"])
    out["mesh_2d"] = mesh_2d.backend_mesh.mesh_dim_names
    out["layout_2d"] = keras.distribution.TensorLayout(
        ("batch", "model"), mesh_2d
    ).backend_layout.placements
    big = keras.distribution.DeviceMesh(
        (world * 2,), ["model"], devices=[f"cpu:{i}" for i in range(world * 2)]
    )
    out["err_big_mesh"] = _expect_value_error(lambda: big.backend_mesh)
    dist = keras.distribution.ModelParallel(layout_map=_twice_map(keras, mesh))
    with dist.scope():
        out["err_variable"] = _expect_value_error(
            lambda: keras.Variable(np.zeros((4, 4)), name="w")
        )
    column_map = keras.distribution.LayoutMap(mesh)
    column_map["v"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=column_map).scope():
        variable = keras.Variable(np.zeros((4, 8)), name="v")
    out["variable_plain"] = not isinstance(variable.value, DTensor)
    out["err_plain_input"] = _expect_value_error(
        lambda: keras.distribution.distribute_tensor(glob, too_many)
    )
    out["shard_types"] = (Shard(1), Replicate())
    # A tensor with no gradient is cut to this rank's shard directly: the
    # same shard, shape and stride as Replicate -> Shard's redistribute
    # (uneven chunks, empty ones, another dim, a non-contiguous global).
    cut = []
    for shape, dim in (((7, 3), 0), ((2, 5), 1), ((1, 4), 0), ((3, 4, 5), 2)):
        dense = torch.arange(float(np.prod(shape))).reshape(shape)
        strided = dense.transpose(0, 1).contiguous().transpose(0, 1)
        for value in (dense, strided):
            placements = [Shard(dim)]
            got = shards.shard_global_tensor(
                value, distribution_lib.DTensorLayout(torch_mesh, placements)
            )
            want = DTensor.from_local(
                value, torch_mesh, [Replicate()], run_check=False
            ).redistribute(torch_mesh, placements)
            cut.append(
                (
                    torch.equal(got.to_local(), want.to_local()),
                    got.shape == want.shape,
                    got.stride() == want.stride(),
                    tuple(got.placements) == tuple(want.placements),
                    got.to_local().is_contiguous(),
                )
            )
    out["cut"] = cut

    keras.utils.set_random_seed(7)
    out["random"] = keras.ops.convert_to_numpy(
        keras.random.normal((3,))
    ).tolist()
    return out


def _twice_map(keras, mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["w"] = ("model", "model")
    return layout_map


@pytest.mark.parametrize("world", [1, 2, 4])
def test_backend_module(world):
    results = run_ranks(_backend_checks, world)
    glob = np.arange(48, dtype=np.float32).reshape(6, 8)
    for rank, out in enumerate(results):
        assert out["devices"] == [f"cpu:{i}" for i in range(world)]
        assert out["count"] == out["num_processes"] == world
        assert out["process_id"] == rank
        assert out["mesh"] == ((world,), ("model",))
        assert out["mesh_ranks"] == list(range(world))
        assert out["mesh_cached"]
        assert out["mesh_2d"] == (("model",) if world > 1 else ("batch",))
        # A job of one process runs on plain tensors, checked all the same.
        assert out["plain"] == out["variable_plain"] == (world == 1)
        assert "with axes (None, None, 'model')" in out["err_plain_input"]
        # Sharding over one device is replication.
        sharded = out["shard_types"][0] if world > 1 else Replicate()
        assert out["layout_2d"] == (sharded,)
        assert out["placements"] == (sharded,)
        np.testing.assert_array_equal(
            out["local"], np.array_split(glob, world, axis=1)[rank]
        )
        assert out["full_equal"] and out["same_returned"]
        assert all(all(case) for case in out["cut"]), out["cut"]
        assert out["redistributed"][1]
        np.testing.assert_array_equal(out["grad"], np.full((6, 8), 2.0))
        assert "mesh axis 'model' is used more than once" in out["err_twice"]
        assert (
            "Cannot shard `x/kernel` (6, 8) with axes (None, None, 'model')"
            in out["err_rank"]
        )
        assert (
            f"mesh shape ({world},), axis_names ('model',)" in out["err_rank"]
        )
        assert f"has {world * 2} devices" in out["err_big_mesh"]
        assert f"this job has {world} processes" in out["err_big_mesh"]
        assert "`w` (4, 4)" in out["err_variable"]
        assert "used more than once" in out["err_variable"]
    # Every rank agreed on one seed and draws the same stream.
    assert len({out["seed"] for out in results}) == 1
    assert all(out["random"] == results[0]["random"] for out in results)


def _multi_axis_checks():
    import keras
    import torch

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    glob = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    from keras_dtensor.backend.distribution_lib import DTensorLayout
    from keras_dtensor.backend.layout import to_placements

    # One dimension over two mesh axes, major to minor in mesh order.
    placements = to_placements(
        (("batch", "model"),), (2, 2), ("batch", "model")
    )
    layout = DTensorLayout(mesh.backend_mesh, placements)
    sharded = keras.distribution.distribute_tensor(glob, layout)
    data_layout = keras.distribution.TensorLayout(("batch", None), mesh)
    by_batch = keras.distribution.distribute_tensor(glob, data_layout)
    return {
        "coordinate": tuple(mesh.backend_mesh.get_coordinate()),
        "local": sharded.to_local().numpy(),
        "full_equal": bool(torch.equal(sharded.full_tensor(), glob)),
        "batch_local": by_batch.to_local().numpy(),
    }


def test_multi_axis_sharding_on_2x2_mesh():
    results = run_ranks(_multi_axis_checks, 4)
    glob = np.arange(24, dtype=np.float32).reshape(8, 3)
    for rank, out in enumerate(results):
        row, col = divmod(rank, 2)
        assert out["coordinate"] == (row, col)
        # JAX order: the 'batch' axis is major, 'model' minor.
        np.testing.assert_array_equal(
            out["local"], glob[2 * rank : 2 * rank + 2]
        )
        assert out["full_equal"]
        np.testing.assert_array_equal(
            out["batch_local"], glob[4 * row : 4 * row + 4]
        )
