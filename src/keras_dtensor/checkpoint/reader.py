"""Reading sharded checkpoints: allow-listed metadata, direct reads.

`SafeReader` refuses what DCP would unpickle freely and reads a plain
contiguous tensor straight into the destination; anything else goes
through DCP's reader.
"""

import collections
import dataclasses
import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

from keras_dtensor.backend.layout import contiguous_strides
from keras_dtensor.checkpoint import manifest

__all__ = ["SafeReader"]


class _Window(io.RawIOBase):
    """Bytes `[offset, offset + length)` of an open file, read-only."""

    def __init__(self, file, offset, length):
        super().__init__()
        self._file, self._offset, self._length = file, offset, length
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=os.SEEK_SET):
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos}.get(whence)
        self._pos = max(0, (self._length if base is None else base) + pos)
        return self._pos

    def readinto(self, buffer):
        size = max(0, min(len(buffer), self._length - self._pos))
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer)[:size])
        self._pos += got
        return got


_Storage = collections.namedtuple("_Storage", "dtype key numel")
# A tensor record of a `torch.save` zip: where its bytes lie (`data_start`:
# of the storage's bytes, within the item).
_Saved = collections.namedtuple(
    "_Saved", "storage offset size stride data_start", defaults=(0,)
)


def _describe(storage, offset, size, stride, *rest):
    return _Saved(storage, int(offset), tuple(size), tuple(stride))


class _TensorRecord(pickle.Unpickler):
    """Reads one tensor's `data.pkl` into a `_Saved`; runs nothing."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _describe
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            kind = getattr(torch, name, None)
            with warnings.catch_warnings():  # TypedStorage is deprecated
                warnings.simplefilter("ignore")
                dtype = getattr(kind, "dtype", None)
            if isinstance(dtype, torch.dtype):
                return dtype  # the storage's class stands for its dtype
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], torch.dtype)
        ):
            return _Storage(pid[1], str(pid[2]), int(pid[4]))
        raise pickle.UnpicklingError("not a plain tensor storage")


def _record_start(window, info):
    """Where a stored (uncompressed) zip entry's bytes begin."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError("compressed")
    window.seek(info.header_offset)
    header = window.read(zipfile.sizeFileHeader)  # short: a struct.error
    # The layout `zipfile` reads: the name's and extra field's lengths last.
    signature, *_, name_length, extra_length = struct.unpack(
        zipfile.structFileHeader, header
    )
    if signature != zipfile.stringFileHeader:
        raise ValueError("bad local header")
    return (
        info.header_offset + zipfile.sizeFileHeader + name_length + extra_length
    )


def _saved_tensor(window):
    """The `_Saved` of a DCP item (one `torch.save`d tensor), or `None`."""
    if sys.byteorder != "little":
        return None
    try:
        archive = zipfile.ZipFile(window)
        names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(names) != 1:
            return None
        prefix = names[0][: -len("data.pkl")]
        byteorder = archive.NameToInfo.get(prefix + "byteorder")
        if byteorder is not None:
            window.seek(_record_start(window, byteorder))
            if window.read(byteorder.file_size) != b"little":
                return None
        info = archive.getinfo(names[0])
        window.seek(_record_start(window, info))
        saved = _TensorRecord(io.BytesIO(window.read(info.file_size))).load()
        if not isinstance(saved, _Saved):
            return None
        info = archive.getinfo(f"{prefix}data/{saved.storage.key}")
        itemsize = saved.storage.dtype.itemsize
        if info.file_size != saved.storage.numel * itemsize:
            return None
        start = _record_start(window, info)
    except (
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        KeyError,
        ValueError,
        TypeError,
        EOFError,
        struct.error,
    ):
        return None
    return saved._replace(data_start=start)


def _byte_range(saved, offsets, lengths):
    """`(first byte, count)` of the box, if one run of the storage."""
    size = saved.size
    if len(size) != len(offsets) or saved.stride != contiguous_strides(size):
        return None
    # One run: every dimension after the first of length other than 1 whole.
    first = next((d for d, n in enumerate(lengths) if n != 1), len(lengths))
    if tuple(lengths[first + 1 :]) != tuple(size[first + 1 :]):
        return None
    start = saved.offset + sum(
        o * s for o, s in zip(offsets, saved.stride, strict=True)
    )
    count = math.prod(lengths)
    if any(
        o + n > s for o, n, s in zip(offsets, lengths, size, strict=True)
    ) or (start + count > saved.storage.numel):
        return None
    itemsize = saved.storage.dtype.itemsize
    return saved.data_start + start * itemsize, count * itemsize


class SafeReader(dcp.FileSystemReader):
    """DCP's `FileSystemReader`, safe and reading in place."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(self.path, manifest.DCP_METADATA)
        metadata = manifest.read_metadata(path)
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        per_file, fallback = {}, []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise ValueError(
                    f"Checkpoint {os.fspath(self.path)!r} stores "
                    f"{item.dest_index.fqn} as pickled bytes; a keras-dtensor "
                    "checkpoint holds tensors only. Refusing to unpickle it."
                )
            name = os.fspath(
                self.storage_data[item.storage_index].relative_path
            )
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(
                    f"Checkpoint {os.fspath(self.path)!r} places "
                    f"{item.dest_index.fqn} in {name!r}, outside its folder."
                )
            per_file.setdefault(name, []).append(item)
        for relative_path, items in per_file.items():
            with open(os.path.join(self.path, relative_path), "rb") as f:
                layouts = {}
                items.sort(
                    key=lambda i: self.storage_data[i.storage_index].offset
                )
                for item in items:
                    if not self._read_direct(f, item, planner, layouts):
                        fallback.append(item)
        if fallback:
            rest = dataclasses.replace(plan, items=fallback)
            super().read_data(rest, planner).wait()
        done = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_direct(self, f, item, planner, layouts):
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors:
            return False
        place = (info.offset, info.length)
        if place not in layouts:
            layouts[place] = _saved_tensor(_Window(f, *place))
        saved = layouts[place]
        target = planner.resolve_tensor(item).detach()
        lengths = list(item.lengths)
        if (
            saved is None
            or target.dtype != saved.storage.dtype
            or list(target.shape) != lengths
            or not target.is_contiguous()
            or target.device.type != "cpu"
        ):
            return False
        span = _byte_range(saved, list(item.storage_offsets), lengths)
        if span is None:
            return False
        start, count = span
        f.seek(info.offset + start)  # a buffered read fills all it can
        if f.readinto(target.view(-1).view(torch.uint8).numpy()) != count:
            raise ValueError(
                f"Checkpoint file {os.fspath(info.relative_path)} "
                f"ended while reading {item.dest_index.fqn}."
            )
        planner.commit_tensor(item, target)
        return True
