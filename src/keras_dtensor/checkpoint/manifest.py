"""The files of a sharded checkpoint, and how they are checked.

A checkpoint directory holds DCP's files (`.metadata`, `__<rank>_<i>.distcp`)
and the manifest `keras_dtensor.json`, written last: the SHA-256 and size of
every file, the keys with their global shapes and dtypes. Nothing here
trusts the files: the manifest is JSON, every file is hashed before a load
touches the model (the ranks share the hashing), and DCP's pickled
`.metadata` is read through an allow-list of DCP's own metadata types.
"""

import hashlib
import io
import json
import os
import pickle

import torch

from keras_dtensor.backend import agreement
from keras_dtensor.backend import launch

__all__ = [
    "DCP_METADATA",
    "FORMAT",
    "MANIFEST",
    "files_of",
    "gathered_hashes",
    "hash_file",
    "read_manifest",
    "read_metadata",
    "shared_hashes",
    "verify",
]

FORMAT = "keras-dtensor-checkpoint/1"
MANIFEST = "keras_dtensor.json"
DCP_METADATA = ".metadata"
_HASH_BLOCK = 2**20  # bytes read and hashed at a time


def hash_file(path):
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return {"sha256": digest.hexdigest(), "size": size}


def shared_hashes(directory, names):
    """`{name: {sha256, size}}` for `names`, each rank hashing a share."""
    world, rank = launch.world()
    mine = {
        n: hash_file(os.path.join(directory, n)) for n in names[rank::world]
    }
    merged = {}
    for part in launch.all_gather_bytes(json.dumps(mine).encode()):
        merged.update(json.loads(part))
    return merged


def gathered_hashes(directory, names, mine):
    """`{name: {sha256, size}}` for `names` from every rank's digests
    (`mine`: this rank's, taken while writing); files no rank has a digest
    for are hashed here, the ranks sharing them."""
    merged = {}
    for part in launch.all_gather_bytes(json.dumps(mine).encode()):
        merged.update(json.loads(part))
    missing = [n for n in names if n not in merged]
    found = shared_hashes(directory, missing) if missing else {}
    return {n: merged[n] if n in merged else found[n] for n in names}


_SAFE_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata types, torch sizes and dtypes; nothing else."""

    def find_class(self, module, name):
        if module == "torch" and (
            name == "Size"
            or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        if name in _SAFE_DCP_TYPES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint metadata refers to {module}.{name}, which is "
            "not a DCP metadata type: refusing to load it"
        )


def read_metadata(path):
    with open(path, "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()


def files_of(metadata):
    """`{file name: sorted keys stored in it}` from DCP's metadata."""
    out = {}
    for index, info in (metadata.storage_data or {}).items():
        out.setdefault(os.fspath(info.relative_path), set()).add(index.fqn)
    return {name: sorted(keys) for name, keys in out.items()}


def verify(directory, manifest):
    """Checks every file against the manifest; raises on every rank."""
    world, rank = launch.world()
    expected = manifest["files"]
    names = sorted(expected)
    problem = None
    for name in names[rank::world]:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            problem = f"{name} is missing"
        else:
            found = hash_file(path)
            if found["size"] != expected[name]["size"]:
                problem = (
                    f"{name} has {found['size']} bytes, the manifest "
                    f"{expected[name]['size']} (truncated or replaced)"
                )
            elif found["sha256"] != expected[name]["sha256"]:
                problem = f"{name} does not match its SHA-256 (altered)"
        if problem:
            break
    problem = agreement.first_failure(problem)
    if problem is None:
        return
    name = problem.split(" ", 1)[0]
    holds = ""
    if name != DCP_METADATA:
        try:
            metadata = read_metadata(os.path.join(directory, DCP_METADATA))
            keys = files_of(metadata).get(name, [])
        except (OSError, pickle.UnpicklingError, EOFError):
            keys = ["(unknown: the metadata is unreadable too)"]
        holds = f"; it holds {', '.join(keys[:8])}"
        holds += " ..." if len(keys) > 8 else ""
    raise ValueError(
        f"Checkpoint {directory!r} is damaged: {problem}{holds}. "
        "Nothing was loaded."
    )


def read_manifest(directory):
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{directory!r} is not a complete keras-dtensor checkpoint (its "
            f"manifest {MANIFEST} is missing or unreadable: {e})."
        ) from None
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"{directory!r} has format {manifest.get('format')!r}; this "
            f"version reads {FORMAT!r}."
        )
    return manifest
