"""The records of a zip file (APPNOTE.TXT), as `StoredZip` writes them:
members stored, names in UTF-8, ZIP64 fields where needed."""

import struct
import time

__all__ = ["Entry", "end_records"]

_LIMIT = 0xFFFFFFFF  # a size or offset from here on needs ZIP64 fields
_COUNT_LIMIT = 0xFFFF  # as many members or more: a ZIP64 end record
_LOCAL_SIGNATURE = b"PK\x03\x04"
_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")


def _field(value, limit, ones=0xFFFFFFFF):
    """A field of a header: the value, or all ones (see the ZIP64 one)."""
    return value if value < limit else ones


def _dos_time(seconds):
    t = time.localtime(seconds)
    year = max(t.tm_year, 1980)  # no earlier year in the format
    date = (year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday
    return t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2, date


class Entry:
    """What the central directory says of one member."""

    def __init__(self, name, offset, attributes, seconds, size, zip64):
        self.name = name.encode("utf-8")
        self.flags = 0 if name.isascii() else 0x800  # UTF-8 name
        self.offset = offset
        self.attributes = attributes
        self.time, self.date = _dos_time(seconds)
        self.crc = 0
        self.size = size
        # Sizes in a ZIP64 extra field; its length is fixed once written.
        self.zip64 = zip64 or size >= _LIMIT

    def local_header(self):
        """The local header (written again when the member is finished)."""
        zip64 = self.zip64
        extra = struct.pack("<2H2Q", 1, 16, self.size, self.size)
        size = 0xFFFFFFFF if zip64 else self.size
        head = _LOCAL.pack(
            _LOCAL_SIGNATURE,
            45 if zip64 else 20,
            self.flags,
            0,  # stored
            self.time,
            self.date,
            self.crc,
            size,
            size,
            len(self.name),
            len(extra) if zip64 else 0,
        )
        return head + self.name + (extra if zip64 else b"")

    def central_header(self):
        big = [v for v in (self.size, self.size, self.offset) if v >= _LIMIT]
        extra = b""
        if big:
            extra = struct.pack(f"<2H{len(big)}Q", 1, 8 * len(big), *big)
        version = 45 if big else 20
        return (
            _CENTRAL.pack(
                b"PK\x01\x02",
                3 << 8 | version,  # made on Unix
                version,
                self.flags,
                0,
                self.time,
                self.date,
                self.crc,
                _field(self.size, _LIMIT),
                _field(self.size, _LIMIT),
                len(self.name),
                len(extra),
                0,  # comment length
                0,  # disk
                0,  # internal attributes
                self.attributes,
                _field(self.offset, _LIMIT),
            )
            + self.name
            + extra
        )


def end_records(count, start, size):
    """The records after a central directory of `count` members, at
    offset `start`, `size` bytes long."""
    tail = b""
    if count >= _COUNT_LIMIT or start >= _LIMIT or size >= _LIMIT:
        tail = _END64.pack(
            b"PK\x06\x06",
            44,  # the record's size after this field
            3 << 8 | 45,
            45,
            0,
            0,
            count,
            count,
            size,
            start,
        ) + _LOCATOR64.pack(b"PK\x06\x07", 0, start + size, 1)
    return tail + _END.pack(
        b"PK\x05\x06",
        0,
        0,
        _field(count, _COUNT_LIMIT, 0xFFFF),
        _field(count, _COUNT_LIMIT, 0xFFFF),
        _field(size, _LIMIT),
        _field(start, _LIMIT),
        0,
    )
