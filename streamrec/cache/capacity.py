"""How many users of a given history length each cache tier holds, before buying hardware.

The answer is pure arithmetic over the pool geometry: a user of ``L`` tokens occupies
``ceil(L / BS)`` whole blocks on the GPU and on the host (the last block is partly
empty), and ``24 * L`` bytes plus its watermarks in the history store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from streamrec.cache.kv_cache import KVCacheConfig
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
) -> list[CapacityRow]:
    """Rows ``gpu_kv``, ``host_kv`` and ``history_store`` for users of ``history_len``."""
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
    return [
        CapacityRow("gpu_kv", history_len, kv_user, gpu_budget_bytes, gpu_users),
        CapacityRow("host_kv", history_len, kv_user, host_budget_bytes, host_users),
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
