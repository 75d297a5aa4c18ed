"""The manifest of a sharded checkpoint, and how its files are checked.

`keras_dtensor.json` holds each file's size and digest (`crc32_blocks`:
a CRC-32 per `BLOCK` bytes, for accidental damage, not tampering) and
the keys' shapes and dtypes. Nothing here trusts the files: DCP's
pickled `.metadata` is read through an allow-list.
"""

import hashlib
import io
import json
import os
import pickle
import zlib

import torch

from keras_dtensor.backend import consensus
from keras_dtensor.backend import launch

__all__ = [
    "BlockDigest",
    "DCP_METADATA",
    "DIGEST",
    "FORMAT",
    "MANIFEST",
    "gathered_hashes",
    "hash_file",
    "read_manifest",
    "read_metadata",
    "verify",
]

FORMAT = "keras-dtensor-checkpoint/2"
_READS = ("keras-dtensor-checkpoint/1", FORMAT)
BLOCK = 16 * 2**20  # bytes of one block: one CRC-32
# How this version's digests are taken: the manifest's `digest`.
DIGEST = {"algorithm": "crc32_blocks", "block_bytes": BLOCK}
MANIFEST = "keras_dtensor.json"
DCP_METADATA = ".metadata"
_READ = 2**20  # bytes read at a time: the buffer stays in the cache


class BlockDigest:
    """A file's `crc32_blocks`, fed its bytes in order."""

    def __init__(self, block=BLOCK):
        self.block = block
        self.size = 0
        self._crcs = []
        self._fill = block  # the last block is full: the next byte opens one

    def update(self, data):
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            if self._fill == self.block:
                self._crcs.append(0)
                self._fill = 0
            take = min(self.block - self._fill, len(view) - pos)
            self._crcs[-1] = zlib.crc32(view[pos : pos + take], self._crcs[-1])
            self._fill += take
            pos += take
        self.size += len(view)

    def hexdigest(self):
        return "".join(f"{crc:08x}" for crc in self._crcs)


def _read(path, update):
    """Feeds the file's bytes (as long as when opened) to `update`."""
    buffer = memoryview(bytearray(_READ))
    with open(path, "rb", buffering=0) as f:
        size = left = os.fstat(f.fileno()).st_size
        while left and (got := f.readinto(buffer[:left])):
            update(buffer[:got])
            left -= got
    return size


def hash_file(path, block=BLOCK):
    """`{"crc32_blocks", "size"}` of the file at `path`."""
    digest = BlockDigest(block)
    size = _read(path, digest.update)
    return {"crc32_blocks": digest.hexdigest(), "size": size}


def _merged(mine):
    merged = {}
    for part in launch.all_gather_bytes(json.dumps(mine).encode()):
        merged.update(json.loads(part))
    return merged


def gathered_hashes(directory, names, mine):
    """`{name: digest}` for `names` from every rank's digests (`mine`);
    the ranks share hashing the files none has a digest for."""
    merged = _merged(mine)
    missing = [n for n in names if n not in merged]
    if missing:
        world, rank = launch.world()
        paths = {n: os.path.join(directory, n) for n in missing[rank::world]}
        merged.update(_merged({n: hash_file(p) for n, p in paths.items()}))
    return {n: merged[n] for n in names}


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


def _check(directory, name, expected, block):
    """What is wrong with file `name`, or `None`."""
    path = os.path.join(directory, name)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return f"{name} is missing"
    if size != expected["size"]:
        return (
            f"{name} has {size} bytes, the manifest "
            f"{expected['size']} (truncated or replaced)"
        )
    if "crc32_blocks" not in expected:  # format 1: a SHA-256 per file
        digest = hashlib.sha256()
        _read(path, digest.update)
        if digest.hexdigest() != expected["sha256"]:
            return f"{name} does not match its SHA-256 (altered)"
        return None
    found = hash_file(path, block)["crc32_blocks"]
    crcs = expected["crc32_blocks"]
    for i in range(0, max(len(found), len(crcs)), 8):  # 8 hex digits each
        if found[i : i + 8] != crcs[i : i + 8]:
            return (
                f"{name} does not match its CRC-32 in bytes {i // 8 * block} "
                f"to {min((i // 8 + 1) * block, size)} (altered)"
            )
    return None


def verify(directory, manifest):
    """Checks every file against the manifest; raises on every rank."""
    kind = manifest.get("digest") or {}
    block = kind.get("block_bytes")  # None in format 1: a SHA-256 per file
    if manifest["format"] == FORMAT and (
        kind.get("algorithm") != "crc32_blocks"
        or not isinstance(block, int)
        or block <= 0
    ):
        raise ValueError(
            f"Checkpoint {directory!r} has digests {kind!r}; this version "
            "checks crc32_blocks (a CRC-32 per block of block_bytes)."
        )
    world, rank = launch.world()
    expected = manifest["files"]
    problem = None
    for name in sorted(expected)[rank::world]:
        try:
            problem = _check(directory, name, expected[name], block)
        except OSError as e:
            problem = f"{name} cannot be read ({e})"
        except (KeyError, TypeError, ValueError) as e:  # every rank hears
            problem = f"{name} has no usable entry in the manifest ({e!r})"
        if problem:
            break
    problem = consensus.first_failure(problem)
    if problem is None:
        return
    name = problem.split(" ", 1)[0]
    holds = ""
    if name != DCP_METADATA:
        try:
            metadata = read_metadata(os.path.join(directory, DCP_METADATA))
            stored = (metadata.storage_data or {}).items()
            keys = sorted(
                {i.fqn for i, s in stored if os.fspath(s.relative_path) == name}
            )
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
    if manifest.get("format") not in _READS:
        raise ValueError(
            f"{directory!r} has format {manifest.get('format')!r}; this "
            f"version reads {' and '.join(map(repr, _READS))}."
        )
    return manifest
