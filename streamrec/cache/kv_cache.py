"""The paged KV tensors of all cached users, allocated once, and their block pool.

One preallocated ``kv[Lyr, 2, NB, BS, H, d]`` (keys at index 0, values at 1) plus
``ts[NB, BS]`` (int64 ms timestamps of the cached tokens, the time bias needs them)
means no allocation or fragmentation while serving: a user's cache is whatever blocks
its table names. The model reads the pool in place through ``batch_tables`` (no dense
per-step copy of every user's history); new keys/values are scattered into their slots
with one ``index_copy_`` per tensor, exactly as docs/contracts.md prescribes.

With ``dtype = torch.float8_e4m3fn`` (``cache.kv_dtype = "fp8_e4m3"``) the pool holds the
FP8 codes the model's ``prefill``/``extend`` return: half the bytes per token, so about
twice the users per GiB. The codes' scales belong to the model (``models/fp8.py``: one per
layer, K/V and head, fixed by the weights, so a code never depends on which step wrote
it); the cache only moves bytes and never re-quantizes. FP8 tensors are copied through
uint8 views of the same bytes (the CPU has no FP8 ``index_copy_``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamrec.cache.block_pool import BlockPool, Slots, UserKey
from streamrec.errors import CacheError, ConfigError

_TS_BYTES = 8  # int64 timestamp per cached token
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as a dtype every copy kernel supports: FP8 as uint8, else itself."""
    return tensor.view(torch.uint8) if tensor.dtype in _FP8 else tensor


@dataclass(frozen=True)
class KVCacheConfig:
    """Geometry of the pool; the number of blocks comes from a memory budget."""

    num_layers: int
    num_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.num_heads, self.head_dim, self.block_size)
        if min(dims) <= 0:
            raise ConfigError(
                f"KVCacheConfig needs positive dims, got layers={self.num_layers} "
                f"heads={self.num_heads} head_dim={self.head_dim} block_size={self.block_size}"
            )
        if not self.dtype.is_floating_point:
            raise ConfigError(f"KVCacheConfig dtype must be floating point, got {self.dtype}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer plus the token's timestamp."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_heads * self.head_dim * elem + _TS_BYTES

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        n = budget_bytes // self.bytes_per_block
        if n <= 0:
            raise ConfigError(
                f"KV budget of {budget_bytes} bytes holds no block of {self.bytes_per_block} bytes"
            )
        return int(n)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Step metadata (tokens, block tables, slots) to ``device`` without a stream sync.

    A plain ``.to(cuda)`` from pageable memory synchronizes the stream after the copy, so
    the host waits for every kernel queued before it and cannot queue the next phase
    while the GPU runs this one. Through pinned memory (the caching host allocator, which
    keeps a buffer until the copy that reads it has run) the copy is asynchronous.
    """
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor, blocking: bool = True) -> list[np.ndarray]:
    """Step results to the host behind one wait that sleeps instead of spinning.

    ``.cpu()`` per tensor waits for the stream once per tensor, and under CUDA's default
    schedule (more cores than contexts) the waiting thread spins a core: the engine
    thread spent 41 % of its samples so (py-spy, three H100 workers at 5,000 events/s),
    on a host whose cores the event loops and the broker need. Here the copies queue into
    pinned buffers (the caching host allocator) behind the step's kernels, and one
    blocking-sync event waits for them all (``blocking=False``: a spinning one, which
    wakes 0.18-0.31 ms sooner per step on an H100 host; ``bench/host_readback.py``).
    """
    if not tensors or tensors[0].device.type != "cuda":
        return [t.numpy() for t in tensors]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, tensor in zip(hosts, tensors, strict=True):
        host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event(blocking=blocking)
    done.record(torch.cuda.current_stream(tensors[0].device))
    done.synchronize()
    return [host.numpy() for host in hosts]


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now: CUDA free memory, or available RAM on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVCache:
    """KV tensors ``kv[Lyr, 2, NB, BS, H, d]``/``ts[NB, BS]`` plus the ``BlockPool``."""

    def __init__(self, config: KVCacheConfig, num_blocks: int, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks, config.block_size)
        shape = (
            config.num_layers,
            2,
            num_blocks,
            config.block_size,
            config.num_heads,
            config.head_dim,
        )
        self.kv = torch.zeros(shape, dtype=config.dtype, device=self.device)  # [Lyr,2,NB,BS,H,d]
        self.ts = torch.zeros(
            (num_blocks, config.block_size), dtype=torch.int64, device=self.device
        )  # [NB, BS]

    @classmethod
    def from_budget(
        cls,
        config: KVCacheConfig,
        device: torch.device | str,
        *,
        budget_bytes: int | None = None,
        free_fraction: float | None = None,
        cap_bytes: int | None = None,
    ) -> KVCache:
        """Size the pool from bytes, or from a fraction of the device's free memory now
        (at most ``cap_bytes``: on the CPU the RAM is shared with everything else)."""
        if (budget_bytes is None) == (free_fraction is None):
            raise ConfigError(
                f"give exactly one of budget_bytes={budget_bytes} and free_fraction={free_fraction}"
            )
        dev = torch.device(device)
        if free_fraction is not None:
            if not 0.0 < free_fraction <= 1.0:
                raise ConfigError(f"free_fraction must be in (0, 1], got {free_fraction}")
            budget_bytes = int(free_memory_bytes(dev) * free_fraction)
        assert budget_bytes is not None
        if cap_bytes is not None:
            budget_bytes = min(budget_bytes, cap_bytes)
        return cls(config, config.num_blocks_for(budget_bytes), dev)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.ts.nbytes

    def batch_tables(self, users: Sequence[UserKey]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables[B, MB] int32, lens[B] int64)`` on the device; unused entries 0."""
        tables = [self.pool.block_table(u) for u in users]
        widest = max((len(t) for t in tables), default=0)
        out = np.zeros((len(users), max(1, widest)), dtype=np.int32)  # [B, MB]
        for row, table in enumerate(tables):
            out[row, : len(table)] = table
        lens = np.fromiter((self.pool.length(u) for u in users), np.int64, len(users))  # [B]
        return self._to_device(out), self._to_device(lens)

    def write(
        self, slots: Slots | torch.Tensor, k: torch.Tensor, v: torch.Tensor, ts: torch.Tensor
    ) -> None:
        """Scatter ``k/v[Lyr, T, H, d]`` and ``ts[T]`` into the flat slots ``slots[T]``."""
        idx = self._slot_index(slots)  # [T]
        cfg = self.config
        expected = (cfg.num_layers, idx.numel(), cfg.num_heads, cfg.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected or ts.shape != idx.shape:
            raise CacheError(
                f"write expects k/v {expected} and ts ({idx.numel()},), got k "
                f"{tuple(k.shape)} v {tuple(v.shape)} ts {tuple(ts.shape)}"
            )
        if (k.dtype in _FP8 or cfg.dtype in _FP8) and not k.dtype == v.dtype == cfg.dtype:
            raise CacheError(
                f"a {cfg.dtype} pool stores k/v of that dtype only (FP8 codes come quantized "
                f"from the model with its scales), got k {k.dtype} v {v.dtype}"
            )
        flat = (cfg.num_layers, self.num_blocks * cfg.block_size, cfg.num_heads, cfg.head_dim)
        pool = raw(self.kv)
        pool[:, 0].view(flat).index_copy_(1, idx, raw(k.to(self.device, cfg.dtype)))
        pool[:, 1].view(flat).index_copy_(1, idx, raw(v.to(self.device, cfg.dtype)))
        self.ts.view(-1).index_copy_(0, idx, ts.to(self.device, torch.int64))

    def read(
        self, user: UserKey, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense ``(k[Lyr, L, H, d], v[Lyr, L, H, d], ts[L])`` of one user (tests, debugging).

        An FP8 pool returns its codes, or with ``scale [Lyr, 2, H]`` (the model's
        ``kv_quant.scale``) the values they stand for, in fp32.
        """
        length = self.pool.length(user)
        positions = np.arange(length, dtype=np.int64)
        table = np.asarray(self.pool.block_table(user), dtype=np.int64)
        slots = table[positions // self.block_size] * self.block_size
        idx = self._slot_index(slots + positions % self.block_size)
        cfg = self.config
        flat = (cfg.num_layers, self.num_blocks * cfg.block_size, cfg.num_heads, cfg.head_dim)
        k = self.kv[:, 0].reshape(flat).index_select(1, idx)
        v = self.kv[:, 1].reshape(flat).index_select(1, idx)
        if scale is not None:
            per_head = scale.to(self.device, torch.float32)[:, :, None, :, None]  # [Lyr,2,1,H,1]
            k, v = k.float() * per_head[:, 0], v.float() * per_head[:, 1]
        return k, v, self.ts.view(-1).index_select(0, idx)

    def _slot_index(self, slots: Slots | torch.Tensor) -> torch.Tensor:
        if isinstance(slots, torch.Tensor):
            return slots.to(self.device, torch.int64)
        return self._to_device(np.ascontiguousarray(slots, dtype=np.int64))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
