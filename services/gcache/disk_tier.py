"""A storage node's disk tier: one file per value, LRU under a byte budget, indexed again on start.

File format (`<xxh3-128 of the key>.gcv`, little endian):

    magic "GCV2" | key length u16 | value size u64 | value checksum u64 | header check u64 | key (utf-8) | value

The header check (xxh64 of the header before it plus the key) tells a torn header apart without reading the
value; the value's checksum is verified by the store on every read. Writes go to `<name>.tmp`, fsync'd, then
renamed: a crash never leaves a visible partial value (`.tmp` files are removed on start). The header repeats
the key, so even a name collision reads as a bad value, never as another key's bytes.
"""

from __future__ import annotations

import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

MAGIC = b"GCV2"  # (GCV1 files held xxh64 value checksums: a re-index deletes them)
SUFFIX = ".gcv"
_FIXED = struct.Struct("<4sHQQQ")  # magic, key length, value size, value checksum, header check
_HEADER_SEED = 0x6763616368656864
_NAME_RE = re.compile(r"^[0-9a-f]{32}\.gcv$")
MAX_KEY_BYTES = 0xFFFF


def file_name(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX


def encode_header(key: str, size: int, checksum: int) -> bytes:
    kb = key.encode()
    head = struct.pack("<4sHQQ", MAGIC, len(kb), size, checksum)
    return head + struct.pack("<Q", xxhash.xxh64_intdigest(head + kb, seed=_HEADER_SEED)) + kb


@dataclass(frozen=True, slots=True)
class FileHeader:
    key: str
    size: int
    checksum: int
    length: int  # bytes before the value


def parse_header(raw: bytes) -> FileHeader | None:
    """The header at the start of `raw` (which holds at least the fixed part and the key), or None if corrupt."""
    if len(raw) < _FIXED.size:
        return None
    magic, key_len, size, checksum, check = _FIXED.unpack_from(raw)
    kb = raw[_FIXED.size:_FIXED.size + key_len]
    if magic != MAGIC or len(kb) != key_len:
        return None
    if xxhash.xxh64_intdigest(raw[:_FIXED.size - 8] + kb, seed=_HEADER_SEED) != check:
        return None
    try:
        key = kb.decode()
    except UnicodeDecodeError:
        return None
    return FileHeader(key, size, checksum, _FIXED.size + key_len)


def _read_header(f: BinaryIO) -> FileHeader | None:
    fixed = f.read(_FIXED.size)
    if len(fixed) < _FIXED.size:
        return None
    key_len = struct.unpack_from("<H", fixed, 4)[0]
    return parse_header(fixed + f.read(key_len))


@dataclass(slots=True)
class DiskEntry:
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class ReindexResult:
    kept: int
    removed: int  # temporary, truncated, corrupt-header or foreign files deleted
    evicted: int  # valid files deleted to fit the budget (oldest first)


class DiskTier:
    """Committed values on disk, LRU-ordered (the OrderedDict's first entry is the least recently used);
    `used` (value bytes; headers are not counted) never exceeds `capacity`. Not thread-safe: one owner."""

    def __init__(self, directory: str | Path, capacity: int) -> None:
        self.dir = Path(directory)
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()
        self.dir.mkdir(parents=True, exist_ok=True)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def path(self, key: str) -> Path:
        return self.dir / file_name(key)

    def entry(self, key: str) -> DiskEntry | None:
        return self._entries.get(key)

    # -- start -------------------------------------------------------------------------------------------------

    def reindex(self) -> ReindexResult:
        """Index the files already in the directory: valid ones become values (LRU order by mtime, oldest
        first), everything else is deleted; then the oldest are evicted until the budget holds."""
        found: list[tuple[int, str, str, DiskEntry]] = []
        removed = 0
        for p in self.dir.iterdir():
            indexed = self._index_file(p)
            if indexed is None:
                removed += _unlink(p)
            else:
                found.append(indexed)
        for _, _, key, entry in sorted(found, key=lambda t: (t[0], t[1])):
            self._entries[key] = entry
            self.used += entry.size
        return ReindexResult(len(self._entries), removed, self.make_room(0))

    def _index_file(self, p: Path) -> tuple[int, str, str, DiskEntry] | None:
        if not _NAME_RE.match(p.name) or not p.is_file():
            return None
        try:
            with p.open("rb") as f:
                h = _read_header(f)
            st = p.stat()
        except OSError:
            return None
        if h is None or file_name(h.key) != p.name or st.st_size != h.length + h.size:
            return None
        return st.st_mtime_ns, p.name, h.key, DiskEntry(h.size, h.checksum)

    # -- the LRU -----------------------------------------------------------------------------------------------

    def make_room(self, size: int) -> int:
        """Evict least recently used values until `size` more bytes fit; how many were evicted."""
        n = 0
        while self._entries and self.used + size > self.capacity:
            key = next(iter(self._entries))
            self.remove(key)
            n += 1
        return n

    def touch(self, key: str) -> None:
        self._entries.move_to_end(key)
        try:  # mtime is the LRU order the next start sees
            os.utime(self.path(key))
        except OSError:
            pass

    def remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.size
            _unlink(self.path(key))

    # -- IO (one value) ----------------------------------------------------------------------------------------

    def write(self, key: str, data: bytes | bytearray | memoryview, checksum: int) -> bool:
        """Store a value the caller made room for (`make_room(len(data))`); False if the write failed (then
        nothing is visible and no space is used)."""
        final = self.path(key)
        tmp = final.with_name(final.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(encode_header(key, len(data), checksum))
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            _unlink(tmp)
            return False
        self._entries[key] = DiskEntry(len(data), checksum)
        self.used += len(data)
        return True

    def read(self, key: str) -> bytearray | None:
        """The value's bytes if its file is there with the header the index expects and exactly `size` value
        bytes; otherwise the value is removed and None returned. The caller verifies the content checksum."""
        entry = self._entries[key]
        data = self._read_file(key, entry)
        if data is None:
            self.remove(key)
        return data

    def _read_file(self, key: str, entry: DiskEntry) -> bytearray | None:
        try:
            with self.path(key).open("rb") as f:
                h = _read_header(f)
                if h is None or (h.key, h.size, h.checksum) != (key, entry.size, entry.checksum):
                    return None
                data = bytearray(entry.size)
                if f.readinto(data) != entry.size or f.read(1):
                    return None
        except OSError:
            return None
        return data

    def keys_lru(self) -> list[str]:
        """Keys, least recently used first (tests, invariants)."""
        return list(self._entries)

    def check_invariants(self) -> None:
        assert self.used == sum(e.size for e in self._entries.values()), "disk used != sum of values"
        assert 0 <= self.used <= self.capacity, f"disk budget exceeded: {self.used} > {self.capacity}"
        for key in self._entries:
            assert self.path(key).is_file(), f"indexed value without a file: {key}"


def _unlink(p: Path) -> int:
    try:
        p.unlink()
    except OSError:  # gone already, or not ours to delete (a directory)
        return 0
    return 1
