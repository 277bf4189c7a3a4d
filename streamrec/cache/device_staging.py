"""Device staging of disk-tier reads: the host->device copy of a disk hit, off the step.

A disk hit used to copy the user's whole pinned staging slot to the GPU inside the step
(33.6 MB for 2,048 tokens of HSTU-8L, ~0.7 ms of PCIe) before scattering it into the
pool. With device staging the disk tier owns a few GPU buffers of one max-length user
each: a read holding one copies every chunk to the same range of its buffer as soon as
the chunk has landed in pinned memory and passed its CRC (on the reader thread, on the
buffer's own stream), so by the time the step runs the bytes are on the device and the
onload is one device->device scatter into the user's fresh pool blocks.

Stream ordering, per device slot ``D`` (each has its own copy stream, so one user's
copies never queue behind another's wait):

- chunk copy ``pinned[lo:hi] -> D[lo:hi]`` on ``D.stream``, after ``D.stream`` waited for
  ``D.scattered`` (the scatter out of ``D`` of the slot's previous user, recorded on the
  engine stream): the next read never overwrites ``D`` before that scatter has run;
  an event after each chunk copy;
- the scatter on the engine's current stream, after it waited for every chunk's event;
  then ``D.scattered`` and the pinned slot's ``copied`` (the chunk copies read the pinned
  slot, and the engine stream waited for them) are one event recorded after the scatter;
- a read given up without a scatter (a torn file, a revoked user): ``copied`` becomes an
  event on ``D.stream`` after its copies, which first waits for the old ``copied``, so a
  later read of that pinned slot still waits for everything that read it; ``D.scattered``
  is left alone (later copies into ``D`` are on ``D.stream``, after these).

Only a verified read is scattered: unverified bytes may reach ``D``, never the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from streamrec.cache.kv_cache import KVCache, raw, to_device


@dataclass
class DeviceSlot:
    """One user's payload on the GPU, filled chunk by chunk on its own stream."""

    buf: torch.Tensor  # [capacity] uint8 on the device
    stream: torch.cuda.Stream  # the chunk copies into buf
    scattered: torch.cuda.Event | None = None  # the last scatter out of buf


def words(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as int64 words when the last dim allows it (fewer, wider elements
    for the scatter kernel), else as ``raw`` (FP8 as uint8)."""
    tensor = raw(tensor)
    if tensor.shape[-1] * tensor.element_size() % 8 == 0:
        return tensor.view(torch.int64)
    return tensor


class DeviceStaging:
    """``slots`` GPU buffers of ``capacity`` bytes, allocated once; callers hold the disk
    tier's lock around ``take`` and ``give``."""

    def __init__(self, cache: KVCache, capacity: int, slots: int) -> None:
        device = cache.kv.device  # the indexed device ("cuda:0", not "cuda")
        self.cache = cache
        self.capacity = capacity
        self.slots = slots
        self._free: deque[DeviceSlot] = deque(
            DeviceSlot(
                torch.empty(capacity, dtype=torch.uint8, device=device),
                torch.cuda.Stream(device),
            )
            for _ in range(slots)
        )
        self._all = list(self._free)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.slots

    def take(self) -> DeviceSlot | None:
        """The slot freed longest ago (its last scatter most likely ran), or None."""
        return self._free.popleft() if self._free else None

    def give(self, slot: DeviceSlot) -> None:
        self._free.append(slot)

    def copy_chunk(
        self, slot: DeviceSlot, pinned: torch.Tensor, lo: int, hi: int
    ) -> torch.cuda.Event:
        """Reader thread: ``pinned[lo:hi]`` (verified or not) to ``slot.buf[lo:hi]``."""
        with torch.cuda.device(slot.buf.device), torch.cuda.stream(slot.stream):
            if slot.scattered is not None:
                slot.stream.wait_event(slot.scattered)  # the previous user's scatter
            slot.buf[lo:hi].copy_(pinned[lo:hi], non_blocking=True)
            done = torch.cuda.Event()
            done.record(slot.stream)
        return done

    def scatter(
        self,
        slot: DeviceSlot,
        chunks: list[torch.cuda.Event],
        n_blocks: int,
        skip_blocks: int,
        gpu_blocks: list[int],
    ) -> torch.cuda.Event:
        """Engine thread: the slot's blocks ``[skip_blocks:]`` into ``gpu_blocks`` of the
        pool on the current stream; the event after it (also the new ``scattered``)."""
        cache, cfg = self.cache, self.cache.config
        stream = torch.cuda.current_stream(cache.kv.device)
        for event in chunks:
            stream.wait_event(event)
        pool = words(cache.kv)  # [Lyr, 2, NB, BS, H, w]
        kv_bytes = n_blocks * (cfg.bytes_per_block - cfg.block_size * 8)
        kv = slot.buf[:kv_bytes].view(pool.dtype).view(n_blocks, *pool.shape[:2], *pool.shape[3:])
        ts = slot.buf[kv_bytes : n_blocks * cfg.bytes_per_block].view(torch.int64)
        ts = ts.view(n_blocks, cfg.block_size)  # [n, BS]
        ids = to_device(np.asarray(gpu_blocks, dtype=np.int64), cache.kv.device)  # no sync
        pool.index_copy_(2, ids, kv[skip_blocks:].movedim(0, 2))  # [Lyr, 2, n', BS, H, w]
        cache.ts.index_copy_(0, ids, ts[skip_blocks:])
        done = torch.cuda.Event()
        done.record(stream)
        slot.scattered = done
        return done

    def abandon(self, slot: DeviceSlot, copied: torch.cuda.Event | None) -> torch.cuda.Event:
        """A read that will not be scattered: the pinned slot's new ``copied`` event,
        after its copies on ``slot.stream`` and after ``copied``."""
        with torch.cuda.device(slot.buf.device):
            if copied is not None:
                slot.stream.wait_event(copied)
            done = torch.cuda.Event()
            done.record(slot.stream)
        return done

    def close(self) -> None:
        """Wait for every copy into and scatter out of the buffers (they may be freed)."""
        for slot in self._all:
            slot.stream.synchronize()
            if slot.scattered is not None:
                slot.scattered.synchronize()
