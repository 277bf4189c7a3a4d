"""The on-disk format of one user's KV in the disk tier, and the raw I/O it needs.

Layout: a ``HEADER_BYTES`` header, then the payload: the user's blocks' K/V in the host
tier's block-major layout ``[n, Lyr, 2, BS, H, d]``, then their timestamps ``[n, BS]``
int64. The payload starts page-aligned.

Header: a fixed little-endian struct (magic, format version, write sequence number, length
in tokens, blocks, layers, heads, head dim, block size, payload bytes, chunk bytes, chunk
count and the byte lengths of three strings), the strings (user key, model version, dtype
name), a CRC32 per ``CHUNK_BYTES`` of payload, and a CRC32 of everything before it. A
reader accepts a file only if the header's own CRC holds and every field equals what it
expects (``KVFileHeader`` equality), then checks the payload chunk by chunk as it reads.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamrec.errors import CacheError

MAGIC = b"SRKV"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
CHUNK_BYTES = 4 << 20  # checksum and read granularity
SUFFIX = ".kv"
_FIXED = struct.Struct("<4sIQQIIIIIQIIHHH")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class KVFileHeader:
    """What a file claims to hold; a reader compares it with what it expects."""

    seq: int
    length: int
    n_blocks: int
    geometry: tuple[int, int, int, int]  # layers, heads, head_dim, block_size
    payload_bytes: int
    user: str
    model_version: str
    dtype: str

    def pack(self, crcs: list[int]) -> bytes:
        key, version, dtype = self.user.encode(), self.model_version.encode(), self.dtype.encode()
        fixed = _FIXED.pack(
            MAGIC, FORMAT_VERSION, self.seq, self.length, self.n_blocks, *self.geometry,
            self.payload_bytes, CHUNK_BYTES, len(crcs), len(key), len(version), len(dtype),
        )  # fmt: skip
        body = fixed + key + version + dtype + b"".join(_CRC.pack(c) for c in crcs)
        if len(body) + _CRC.size > HEADER_BYTES:
            raise CacheError(f"KV file header of {len(body)} bytes overflows {HEADER_BYTES}")
        body += _CRC.pack(zlib.crc32(body))
        return body + bytes(HEADER_BYTES - len(body))


def parse_header(raw: bytes) -> tuple[KVFileHeader, list[int]] | None:
    """The header and its chunk CRCs, or None when torn, foreign or of another format."""
    if len(raw) < HEADER_BYTES:
        return None
    try:
        fields = _FIXED.unpack_from(raw)
    except struct.error:
        return None
    magic, fmt, seq, length, n_blocks, layers, heads, head_dim, block_size = fields[:9]
    payload, chunk, n_chunks, key_len, version_len, dtype_len = fields[9:]
    if magic != MAGIC or fmt != FORMAT_VERSION or chunk != CHUNK_BYTES:
        return None
    offset = _FIXED.size
    strings = []
    for size in (key_len, version_len, dtype_len):
        strings.append(raw[offset : offset + size])
        offset += size
    end = offset + n_chunks * _CRC.size
    if end + _CRC.size > HEADER_BYTES or _CRC.unpack_from(raw, end)[0] != zlib.crc32(raw[:end]):
        return None
    try:
        user, version, dtype = (s.decode() for s in strings)
    except UnicodeDecodeError:
        return None
    header = KVFileHeader(
        seq, length, n_blocks, (layers, heads, head_dim, block_size), payload, user, version,
        dtype,
    )  # fmt: skip
    crcs = [_CRC.unpack_from(raw, offset + i * _CRC.size)[0] for i in range(n_chunks)]
    return header, crcs


def chunk_crcs(pieces: list[np.ndarray]) -> list[int]:
    """CRC32 of each ``CHUNK_BYTES`` run of the concatenated pieces (no concatenation)."""
    crcs: list[int] = []
    crc, filled = 0, 0
    for piece in pieces:
        view = memoryview(piece)  # type: ignore[arg-type]
        while view.nbytes:
            take = min(view.nbytes, CHUNK_BYTES - filled)
            crc = zlib.crc32(view[:take], crc)
            filled += take
            view = view[take:]
            if filled == CHUNK_BYTES:
                crcs.append(crc)
                crc, filled = 0, 0
    if filled:
        crcs.append(crc)
    return crcs


def write_all(fd: int, data: bytes | np.ndarray, offset: int) -> None:
    view = memoryview(data)  # type: ignore[arg-type]
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view = view[done:]
        offset += done


def read_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``offset``; False if the file ends first or the read fails."""
    done = 0
    try:
        while done < view.nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                return False
            done += got
    except OSError:
        return False
    return True


def temporary(path: Path) -> Path:
    """Where a file is written before the rename that makes it complete."""
    return path.with_name("." + path.name + ".tmp")


def unlink(path: Path) -> None:
    """The file and the temporary a failed write may have left."""
    path.unlink(missing_ok=True)
    temporary(path).unlink(missing_ok=True)
