"""How many users of a given history length each cache tier holds, before buying hardware.

The answer is pure arithmetic over the pool geometry: a user of ``L`` tokens occupies
``ceil(L / BS)`` whole blocks on the GPU, on the host and on disk (the last block is
partly empty; a disk file adds a 4 KiB header), and ``24 * L`` bytes plus its watermarks
in the history store. ``catalog_plan`` says whether an item table fits a GPU budget and,
if not, how many embedding-cache slots and retrievable items the budget buys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from streamrec.cache.kv_cache import KVCacheConfig
from streamrec.cache.kv_file import HEADER_BYTES
from streamrec.errors import ConfigError

HISTORY_TOKEN_BYTES = 24  # (item, action, ts_ms) as three int64
HISTORY_USER_OVERHEAD_BYTES = 256  # keys, watermark hash, allocator slack (estimate)


@dataclass(frozen=True)
class CapacityRow:
    """One tier at one history length."""

    tier: str
    history_len: int
    bytes_per_user: int
    budget_bytes: int | None
    users: int | None  # None when no budget was given for the tier


def _users(budget: int | None, per_user: int) -> int | None:
    return None if budget is None else budget // per_user


def capacity_report(
    kv: KVCacheConfig,
    history_len: int,
    gpu_budget_bytes: int,
    host_budget_bytes: int | None = None,
    store_budget_bytes: int | None = None,
    disk_budget_bytes: int | None = None,
) -> list[CapacityRow]:
    """Rows ``gpu_kv``, ``host_kv``, ``disk_kv`` and ``history_store`` for users of
    ``history_len``."""
    if history_len <= 0 or gpu_budget_bytes <= 0:
        raise ConfigError(
            f"capacity report needs history_len > 0 and a GPU budget > 0, got "
            f"history_len={history_len} gpu_budget_bytes={gpu_budget_bytes}"
        )
    blocks = math.ceil(history_len / kv.block_size)
    kv_user = blocks * kv.bytes_per_block
    gpu_users = kv.num_blocks_for(gpu_budget_bytes) // blocks
    host_users = None
    if host_budget_bytes is not None:
        host_users = (host_budget_bytes // kv.bytes_per_block) // blocks
    store_user = history_len * HISTORY_TOKEN_BYTES + HISTORY_USER_OVERHEAD_BYTES
    disk_user = HEADER_BYTES + kv_user
    return [
        CapacityRow("gpu_kv", history_len, kv_user, gpu_budget_bytes, gpu_users),
        CapacityRow("host_kv", history_len, kv_user, host_budget_bytes, host_users),
        CapacityRow(
            "disk_kv",
            history_len,
            disk_user,
            disk_budget_bytes,
            _users(disk_budget_bytes, disk_user),
        ),
        CapacityRow(
            "history_store",
            history_len,
            store_user,
            store_budget_bytes,
            _users(store_budget_bytes, store_user),
        ),
    ]


def capacity_table(rows: list[tuple[str, int, CapacityRow]]) -> str:
    """Plain-text table of ``(model name, block size, row)`` triples, for CLIs and benches."""
    line = "{:<12} {:>5} {:>8} {:<14} {:>14} {:>10} {:>12}"
    out = [line.format("model", "block", "history", "tier", "bytes/user", "budget GiB", "users")]
    for model, block_size, row in rows:
        budget = "-" if row.budget_bytes is None else f"{row.budget_bytes / 2**30:.0f}"
        users = "-" if row.users is None else f"{row.users:,}"
        out.append(
            line.format(
                model,
                block_size,
                row.history_len,
                row.tier,
                f"{row.bytes_per_user:,}",
                budget,
                users,
            )
        )
    return "\n".join(out)


@dataclass(frozen=True)
class CatalogPlan:
    """Where an item table of ``num_items`` rows lives under a GPU budget."""

    num_items: int
    row_bytes: int
    table_bytes: int
    gpu_budget_bytes: int
    fits: bool  # the whole table on the GPU: exact retrieval, no cache
    cache_slots: int  # embedding-cache rows on the GPU (== num_items when it fits)
    retrievable: int  # items retrieval scores (normalised rows on the GPU)


def catalog_plan(
    num_items: int, d_model: int, dtype_bytes: int, gpu_budget_bytes: int, slot_share: float = 0.5
) -> CatalogPlan:
    """Split a GPU budget between embedding-cache slots and the retrievable set.

    Past the budget, ``slot_share`` of it buys cache slots and the rest the retrievable
    set; each row costs ``d_model * dtype_bytes`` (plus 8 bytes of item id per member).
    """
    if min(num_items, d_model, dtype_bytes, gpu_budget_bytes) <= 0 or not 0 < slot_share < 1:
        raise ConfigError(
            f"catalog plan needs positive sizes and 0 < slot_share < 1, got num_items="
            f"{num_items} d_model={d_model} dtype_bytes={dtype_bytes} "
            f"gpu_budget_bytes={gpu_budget_bytes} slot_share={slot_share}"
        )
    row = d_model * dtype_bytes
    table = num_items * row
    if table <= gpu_budget_bytes:
        return CatalogPlan(num_items, row, table, gpu_budget_bytes, True, num_items, num_items)
    slots = min(num_items, int(gpu_budget_bytes * slot_share) // row)
    members = min(num_items, int(gpu_budget_bytes * (1 - slot_share)) // (row + 8))
    return CatalogPlan(num_items, row, table, gpu_budget_bytes, False, slots, members)
