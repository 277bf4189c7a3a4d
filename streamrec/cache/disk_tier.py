"""Third KV tier: users that fall out of the host tier wait in files on local disk.

A user dropped by the host tier used to cost a full prefill on its next event. Local NVMe
holds terabytes, and reading a user's blocks back (32 MB for 2,048 tokens of HSTU-8L)
costs a fraction of re-encoding them, so the host tier's least recently used users are
written to one file each and read back on their next event.

Writes never block a step in the common case: ``KVTiers`` asks for the host tier's LRU
tail to be written in the background (``write``), straight from the pinned host blocks
(no copy), so by the time the host tier needs those blocks the user is already on disk and
dropping it is free. A user whose write is still running cannot leave the host tier until
it is done (``store`` / ``discard`` wait), so a file never holds bytes of a reused block.

Reads are asynchronous: ``prefetch`` (thread-safe; the engine calls it when it plans a
batch) reads a file in chunks on a thread pool into a pinned staging slot and checksums
each chunk as it lands; ``load`` waits for that and verifies; ``onload`` copies the slot
into fresh GPU blocks (one host→device copy, like the host tier's). On CUDA a read that
also holds one of the tier's ``device_slots`` copies each checked chunk on to the GPU as it
lands, so its ``onload`` is a device→device scatter with no host→device copy in the step
(``device_staging``: the streams and events that order it); without a free device slot,
or on the CPU, the read is onloaded from the pinned slot as above.

Crash safety. A file is written under a temporary name and renamed when complete. Its
header carries a magic, the format version, the model version, the KV geometry and dtype,
the user key, a write sequence number, the length, a CRC32 per 4 MiB chunk of payload and
a CRC32 of the header itself. A torn, truncated, foreign or stale file (another model
version, an older write of the user) fails ``load`` and the user is a miss, rebuilt from
the history store: never wrong data. Files of an earlier process are removed at start
(the engine rebuilds users it holds no state for, so they could never be used), and at
``close``.

Size is bounded: writing past ``budget_bytes`` first deletes the least recently written
idle files (a user only on disk is then gone, like a host-tier drop without a disk).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamrec.cache.block_pool import UserKey
from streamrec.cache.device_staging import DeviceSlot, DeviceStaging
from streamrec.cache.host_tier import HostCopy, block_runs
from streamrec.cache.kv_cache import KVCache, raw
from streamrec.cache.kv_file import (
    CHUNK_BYTES,
    HEADER_BYTES,
    SUFFIX,
    KVFileHeader,
    chunk_crcs,
    parse_header,
    read_into,
    temporary,
    unlink,
    write_all,
)
from streamrec.cache.stats import DiskTierStats
from streamrec.errors import CacheError, ConfigError


@dataclass
class _Slot:
    """A staging buffer one user is read into: pinned and reused, or a one-off."""

    buf: torch.Tensor  # [capacity] uint8
    view: np.ndarray  # the same memory as NumPy, for preadv
    copied: torch.cuda.Event | None = None  # the last host->device copy out of it is done
    one_off: bool = False  # pageable, allocated by a step that found every slot busy


_Chunk = tuple[int, float, torch.cuda.Event | None]  # CRC32 as read, finish time, copy


@dataclass
class _Read:
    fd: int
    slot: _Slot
    header: Future[list[int] | None]  # chunk CRCs the header promises, None if invalid
    chunks: list[Future[_Chunk]]  # the event: the chunk's copy into ``device`` (if any)
    started: float
    device: DeviceSlot | None = None  # set: chunks are copied on to the GPU as they land
    copies: list[torch.cuda.Event] = field(default_factory=list)  # once verified
    verified: bool = False
    scattered: bool = False  # onloaded from ``device``


@dataclass
class _Entry:
    seq: int
    length: int
    n_blocks: int
    nbytes: int
    path: Path
    write: Future[None] | None = None  # running (or finished, until accounted)
    read: _Read | None = None


def payload_bytes(cache: KVCache, n_blocks: int) -> int:
    return n_blocks * cache.config.bytes_per_block


def file_bytes(cache: KVCache, n_blocks: int) -> int:
    """Disk bytes of a user of ``n_blocks`` blocks (header + K/V + timestamps)."""
    return HEADER_BYTES + payload_bytes(cache, n_blocks)


class DiskTier:
    """File-backed KV of users evicted from the host tier: one file per user."""

    def __init__(
        self,
        cache: KVCache,
        directory: Path | str,
        budget_bytes: int,
        model_version: str,
        *,
        max_blocks: int,
        staging_users: int = 16,
        read_threads: int = 8,
        write_threads: int = 2,
        fsync: bool = False,
        device_slots: int = 4,
    ) -> None:
        if budget_bytes < file_bytes(cache, max_blocks):
            raise ConfigError(
                f"disk tier budget of {budget_bytes} bytes holds no user of {max_blocks} blocks "
                f"({file_bytes(cache, max_blocks)} bytes)"
            )
        if min(staging_users, read_threads, write_threads, max_blocks) <= 0:
            raise ConfigError(
                f"disk tier needs staging_users={staging_users}, read_threads={read_threads}, "
                f"write_threads={write_threads}, max_blocks={max_blocks} all > 0"
            )
        if device_slots < 0:
            raise ConfigError(f"disk tier needs device_slots >= 0, got {device_slots}")
        self.cache = cache
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.model_version = model_version
        self.max_blocks = max_blocks
        self.fsync = fsync
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._wipe()
        except OSError as exc:
            raise ConfigError(f"disk tier directory {str(self.directory)!r}: {exc}") from exc
        cfg = cache.config
        self._kv_block = cfg.bytes_per_block - cfg.block_size * 8  # K/V bytes of one block
        pin = cache.device.type == "cuda"
        capacity = payload_bytes(cache, max_blocks)
        self._free_slots: deque[_Slot] = deque()  # freed longest ago first: its copy is done
        for _ in range(staging_users):
            buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
            self._free_slots.append(_Slot(buf, buf.numpy()))
        # GPU buffers a read copies into as it lands (on top of the KV budget); only with
        # a pinned slot, so more than staging_users would never be used.
        n_dev = min(device_slots, staging_users) if pin else 0
        self._staging = DeviceStaging(cache, capacity, n_dev) if n_dev else None
        self._lock = threading.Lock()  # entries and slots: prefetch runs on another thread
        self._entries: OrderedDict[UserKey, _Entry] = OrderedDict()  # oldest write first
        self._writing: set[UserKey] = set()
        self._bytes = 0
        self._seq = 0
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="streamrec-disk-r")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="streamrec-disk-w")
        self._n = dict.fromkeys(
            (
                "writes", "bytes_written", "write_failures", "sync_writes", "evictions",
                "rejects", "prefetches", "late_reads", "waited_reads", "loads", "bytes_read",
                "verify_failures", "staging_full", "device_staged_loads", "device_staging_full",
            ),
            0,
        )  # fmt: skip
        self._read_s = 0.0

    # ------------------------------------------------------------------ queries

    def __contains__(self, user: object) -> bool:
        return user in self._entries

    def length(self, user: UserKey) -> int:
        return self._entry(user).length

    def user_blocks(self, user: UserKey) -> int:
        return self._entry(user).n_blocks

    def is_written(self, user: UserKey) -> bool:
        """A completed, successful write of ``user`` is on disk."""
        entry = self._entries.get(user)
        return entry is not None and entry.write is None

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing)

    # ------------------------------------------------------------------ writes

    def write(self, user: UserKey, copy: HostCopy) -> bool:
        """Start writing ``user``'s host copy in the background; False if no room."""
        n = len(copy.blocks)
        if n > self.max_blocks:
            raise CacheError(
                f"user {user!r} has {n} blocks, more than max_blocks={self.max_blocks}"
            )
        self.discard(user)  # an older copy (waits for its write: never two at once)
        with self._lock:
            nbytes = file_bytes(self.cache, n)
            if not self._make_room(nbytes):
                self._n["rejects"] += 1
                return False
            self._seq += 1
            entry = _Entry(
                self._seq, copy.length, n, nbytes, self.directory / f"{self._seq:016x}{SUFFIX}"
            )
            self._entries[user] = entry
            self._bytes += nbytes
            self._writing.add(user)
            entry.write = self._writers.submit(self._write_file, user, entry, copy)
        return True

    def store(self, user: UserKey, copy: HostCopy) -> bool:
        """Make sure ``user`` is completely on disk (wait, or write now); False on failure.

        The host tier calls this before it reuses the user's blocks.
        """
        entry = self._entries.get(user)
        if entry is None:
            self._n["sync_writes"] += 1
            if not self.write(user, copy):
                return False
            entry = self._entries[user]
        elif entry.write is not None:
            self._n["sync_writes"] += 1
        return self._finish_write(user, entry)

    def reap(self) -> None:
        """Account finished background writes (a failed one is forgotten)."""
        for user in list(self._writing):
            entry = self._entries[user]
            if entry.write is not None and entry.write.done():
                self._finish_write(user, entry)

    def _finish_write(self, user: UserKey, entry: _Entry) -> bool:
        future = entry.write
        if future is None:
            return True
        try:
            future.result()
        except (OSError, CacheError):  # disk full, I/O error, a key too long for a header
            self._n["write_failures"] += 1
            with self._lock:
                entry.write = None
                self._writing.discard(user)
                if self._entries.get(user) is entry:
                    self._discard_locked(user)
            return False
        with self._lock:
            entry.write = None
            self._writing.discard(user)
        self._n["writes"] += 1
        self._n["bytes_written"] += entry.nbytes
        return True

    def _write_file(self, user: UserKey, entry: _Entry, copy: HostCopy) -> None:
        """Runs on a writer thread: header + payload to a temporary name, then rename."""
        if copy.ready is not None:
            copy.ready.synchronize()  # the device->host copy into these blocks has landed
        pieces = [
            copy.kv[first : first + count].view(torch.uint8).numpy().reshape(-1)
            for _, first, count in block_runs(list(copy.blocks))
        ] + [
            copy.ts[first : first + count].view(torch.uint8).numpy().reshape(-1)
            for _, first, count in block_runs(list(copy.blocks))
        ]
        crcs = chunk_crcs(pieces)
        header = self._expected_header(user, entry).pack(crcs)
        tmp = temporary(entry.path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(fd, header, 0)
            offset = HEADER_BYTES
            for piece in pieces:
                write_all(fd, piece, offset)
                offset += piece.size
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, entry.path)

    def _expected_header(self, user: UserKey, entry: _Entry) -> KVFileHeader:
        cfg = self.cache.config
        return KVFileHeader(
            seq=entry.seq,
            length=entry.length,
            n_blocks=entry.n_blocks,
            geometry=(cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.block_size),
            payload_bytes=payload_bytes(self.cache, entry.n_blocks),
            user=user,
            model_version=self.model_version,
            dtype=str(cfg.dtype),
        )

    def _make_room(self, nbytes: int) -> bool:
        """Delete idle files, oldest first, until ``nbytes`` more fit (lock held)."""
        short = self._bytes + nbytes - self.budget_bytes
        if short <= 0:
            return True
        victims: list[UserKey] = []
        for user, entry in self._entries.items():
            if short <= 0:
                break
            if entry.write is None and entry.read is None:
                victims.append(user)
                short -= entry.nbytes
        if short > 0:
            return False
        for user in victims:
            self._discard_locked(user, unlink_now=True)  # the bound is on bytes on disk
            self._n["evictions"] += 1
        return True

    # ------------------------------------------------------------------ reads

    def prefetch(self, user: UserKey) -> bool:
        """Start reading ``user``'s file into a staging slot (thread-safe); True if started."""
        return self._start_read(user, one_off=False)

    def _start_read(self, user: UserKey, one_off: bool) -> bool:
        """Read into a free pinned slot, or (``one_off``: a step that must have the user
        now) into a pageable buffer of its own when all slots are busy."""
        with self._lock:
            entry = self._entries.get(user)
            if entry is None or entry.write is not None or entry.read is not None:
                return False
            if self._free_slots:
                slot = self._free_slots.popleft()
            elif one_off:
                buf = torch.empty(payload_bytes(self.cache, entry.n_blocks), dtype=torch.uint8)
                slot = _Slot(buf, buf.numpy(), one_off=True)
            else:
                self._n["staging_full"] += 1
                return False
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except OSError:
                fd = -1  # the header read reports the file as invalid
            device = None
            if self._staging is not None and not slot.one_off:
                device = self._staging.take()
                if device is None:
                    self._n["device_staging_full"] += 1  # onloaded from the pinned slot
            started = time.perf_counter()
            header = self._readers.submit(self._read_header, fd, user, entry)
            payload = payload_bytes(self.cache, entry.n_blocks)
            chunks = [
                self._readers.submit(
                    self._read_chunk, fd, slot, device, lo, min(payload, lo + CHUNK_BYTES)
                )
                for lo in range(0, payload, CHUNK_BYTES)
            ]
            # Published whole: ``load`` on the engine thread reads it without the lock.
            entry.read = _Read(fd, slot, header, chunks, started, device)
            self._n["prefetches" if not one_off else "late_reads"] += 1
        return True

    def load(self, user: UserKey) -> bool:
        """Wait for ``user``'s read and verify it; False (and forgotten) if torn or stale."""
        entry = self._entry(user)
        if entry.write is not None and not self._finish_write(user, entry):
            return False
        if entry.read is None:
            self._start_read(user, one_off=True)  # (or a prefetch just started one)
        read = entry.read
        assert read is not None
        if read.verified:
            return True
        if not read.header.done() or not all(f.done() for f in read.chunks):
            self._n["waited_reads"] += 1
        expected = read.header.result()
        chunks = [f.result() for f in read.chunks]
        if read.fd >= 0:
            os.close(read.fd)
            read.fd = -1
        if expected is None or expected != [crc for crc, _, _ in chunks]:
            self._n["verify_failures"] += 1
            self.discard(user)
            return False
        read.copies = [copy for _, _, copy in chunks if copy is not None]
        read.verified = True
        finished = max((end for _, end, _ in chunks), default=read.started)
        self._read_s += finished - read.started
        return True

    def onload(self, user: UserKey, gpu_blocks: list[int], skip_blocks: int = 0) -> int:
        """Copy a loaded user into ``gpu_blocks`` (its oldest ``skip_blocks`` dropped by the
        sliding window) and forget it here; the length copied."""
        entry = self._entry(user)
        read = entry.read
        if read is None or not read.verified:
            raise CacheError(f"onload of user {user!r} from disk before load() verified it")
        n = entry.n_blocks
        if len(gpu_blocks) != n - skip_blocks:
            raise CacheError(
                f"onload of user {user!r} needs {n - skip_blocks} GPU blocks, got {len(gpu_blocks)}"
            )
        cfg, cache = self.cache.config, self.cache
        if read.device is not None and self._staging is not None and gpu_blocks:
            # Every chunk was copied to the device slot (load waited for the copies to be
            # queued): a device->device scatter after them, nothing from the host.
            done = self._staging.scatter(read.device, read.copies, n, skip_blocks, gpu_blocks)
            read.slot.copied = done  # the chunk copies out of the pinned slot came before
            read.scattered = True
            self._n["device_staged_loads"] += 1
            return self._onloaded(user, entry, skip_blocks)
        kv = read.slot.buf[: n * self._kv_block].view(cfg.dtype)
        kv = kv.view(n, cfg.num_layers, 2, cfg.block_size, cfg.num_heads, cfg.head_dim)
        ts = read.slot.buf[n * self._kv_block : n * cfg.bytes_per_block].view(torch.int64)
        ts = ts.view(n, cfg.block_size)
        if gpu_blocks:
            ids = torch.tensor(gpu_blocks, dtype=torch.int64, device=cache.device)
            kv_dev = kv[skip_blocks:].to(cache.device, non_blocking=True)  # [n', Lyr, 2, BS, H, d]
            # (FP8 codes as their bytes: index_copy_ has no FP8 kernel)
            raw(cache.kv).index_copy_(2, ids, raw(kv_dev).movedim(0, 2))  # [Lyr,2,NB,BS,H,d]
            cache.ts.index_copy_(0, ids, ts[skip_blocks:].to(cache.device, non_blocking=True))
        if cache.device.type == "cuda" and read.device is None:
            read.slot.copied = torch.cuda.Event()
            read.slot.copied.record()
        return self._onloaded(user, entry, skip_blocks)

    def _onloaded(self, user: UserKey, entry: _Entry, skip_blocks: int) -> int:
        self._n["loads"] += 1
        self._n["bytes_read"] += payload_bytes(self.cache, entry.n_blocks)
        length = max(0, entry.length - skip_blocks * self.cache.block_size)
        self.discard(user)
        return length

    def _read_header(self, fd: int, user: UserKey, entry: _Entry) -> list[int] | None:
        """The chunk CRCs a valid header promises, or None (torn, foreign or stale)."""
        if fd < 0:
            return None
        try:
            parsed = parse_header(os.pread(fd, HEADER_BYTES, 0))
            size = os.fstat(fd).st_size
        except OSError:
            return None
        if parsed is None:
            return None
        header, crcs = parsed
        expected = self._expected_header(user, entry)
        if header != expected or size != HEADER_BYTES + expected.payload_bytes:
            return None
        return crcs

    def _read_chunk(
        self, fd: int, slot: _Slot, device: DeviceSlot | None, lo: int, hi: int
    ) -> _Chunk:
        """Read payload bytes ``[lo, hi)`` into the slot (and copy them on to ``device``):
        (their CRC32 or -1, finish time, the device copy's event)."""
        if fd < 0:
            return -1, time.perf_counter(), None
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous user's host->device copy is done
        view = memoryview(slot.view[lo:hi])  # type: ignore[arg-type]
        if not read_into(fd, view, HEADER_BYTES + lo):
            return -1, time.perf_counter(), None
        crc = zlib.crc32(view)
        copy = None
        if device is not None and self._staging is not None:  # verified or not: load decides
            copy = self._staging.copy_chunk(device, slot.buf, lo, hi)
        return crc, time.perf_counter(), copy

    # ------------------------------------------------------------------ release

    def discard(self, user: UserKey) -> None:
        """Forget ``user`` (it went back to the GPU, was revoked, or failed); waits for
        its write, since the host blocks it reads may be reused right after."""
        entry = self._entries.get(user)
        if entry is None:
            return
        if entry.write is not None:
            self._finish_write(user, entry)
        with self._lock:
            if self._entries.get(user) is entry:
                self._discard_locked(user)

    def _discard_locked(self, user: UserKey, unlink_now: bool = False) -> None:
        entry = self._entries.pop(user)
        self._writing.discard(user)
        self._bytes -= entry.nbytes
        read = entry.read
        if read is not None:
            futures: list[Future[Any]] = [read.header, *read.chunks]
            for future in futures:
                future.cancel()
            for future in futures:
                if not future.cancelled():
                    future.exception()  # a running chunk still writes into the slot
            if read.fd >= 0:
                os.close(read.fd)
                read.fd = -1
            if read.device is not None and self._staging is not None:
                if not read.scattered:  # its chunk copies still read the pinned slot
                    read.slot.copied = self._staging.abandon(read.device, read.slot.copied)
                self._staging.give(read.device)
            if not read.slot.one_off:
                self._free_slots.append(read.slot)
            entry.read = None
        if unlink_now:
            unlink(entry.path)
        else:  # off the engine thread: freeing a large file's pages takes a while
            self._writers.submit(unlink, entry.path)

    def close(self) -> None:
        """Wait for the threads and delete every file."""
        for user in list(self._entries):
            self.discard(user)
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        if self._staging is not None:
            self._staging.close()
        with contextlib.suppress(OSError):
            self._wipe()

    def stats(self) -> DiskTierStats:
        n = self._n
        return DiskTierStats(
            budget_bytes=self.budget_bytes,
            bytes_used=self._bytes,
            users=len(self._entries),
            writes=n["writes"],
            bytes_written=n["bytes_written"],
            write_failures=n["write_failures"],
            sync_writes=n["sync_writes"],
            evictions=n["evictions"],
            rejects=n["rejects"],
            prefetches=n["prefetches"],
            late_reads=n["late_reads"],
            waited_reads=n["waited_reads"],
            loads=n["loads"],
            bytes_read=n["bytes_read"],
            read_seconds=self._read_s,
            verify_failures=n["verify_failures"],
            staging_full=n["staging_full"],
            device_slots=0 if self._staging is None else self._staging.slots,
            device_staging_bytes=0 if self._staging is None else self._staging.nbytes,
            device_staged_loads=n["device_staged_loads"],
            device_staging_full=n["device_staging_full"],
        )

    def _entry(self, user: UserKey) -> _Entry:
        entry = self._entries.get(user)
        if entry is None:
            raise CacheError(f"user {user!r} is not in the disk tier")
        return entry

    def _wipe(self) -> None:
        for path in self.directory.iterdir():
            if path.name.endswith(SUFFIX) or path.name.endswith(SUFFIX + ".tmp"):
                path.unlink(missing_ok=True)
