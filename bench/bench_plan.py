"""What a worker bench run sends, and the KV pool that holds it: ``Plan`` and budgets.

Every event's user is drawn up front (``make_plan``) because the KV pool is sized before
the run so that every user fits at its final, window-capped length: the bench measures
serving, never eviction (``kv_budget``; per process of a group, ``process_kv_budget``,
from the partitions the range assignor can give one member).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from bench.event_producer import partition_of
from bench.null_model import NULL_GEOMETRY
from bench.reference_config import ReferenceWorkload
from streamrec.cache.kv_cache import KVCacheConfig

IntArray = npt.NDArray[np.int64]
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Plan:
    """Every event's user, drawn up front (the KV budget needs each user's final length)."""

    lengths: IntArray  # [U] preloaded tokens per user
    prime: list[IntArray]
    throughput: IntArray
    rates: list[tuple[float, IntArray]]


def make_plan(w: ReferenceWorkload, ns: argparse.Namespace, rng: np.random.Generator) -> Plan:
    weights = 1.0 / np.arange(1, ns.users + 1) ** ns.skew  # skew 0: uniform
    weights /= weights.sum()

    def draw(n: int) -> IntArray:
        return rng.choice(ns.users, size=n, p=weights).astype(np.int64)

    sizes = sorted({min(s, ns.users) for s in (1, 16, 17, ns.max_batch_users)})
    return Plan(
        lengths=w.history_lengths(ns.users, seed=ns.seed),
        prime=[np.arange(s, dtype=np.int64) for s in sizes],
        throughput=draw(ns.events),
        rates=[(float(r), draw(int(r * ns.seconds))) for r in ns.rates],
    )


def geometry(w: ReferenceWorkload, host_ceiling: bool) -> KVCacheConfig:
    if host_ceiling:
        g = NULL_GEOMETRY
        return KVCacheConfig(
            g["num_layers"], g["num_heads"], g["head_dim"], BLOCK_SIZE, torch.float32
        )
    dtype = getattr(torch, w.dtype)
    return KVCacheConfig(w.num_layers, w.num_heads, w.head_dim, BLOCK_SIZE, dtype)


def user_blocks(w: ReferenceWorkload, plan: Plan) -> IntArray:
    """KV blocks of each user at its final (window-capped) length, +1 block each."""
    every = np.concatenate([*plan.prime, plan.throughput, *(u for _, u in plan.rates)])
    events = np.bincount(every, minlength=len(plan.lengths)) + 1  # + the warm event
    final = np.minimum(plan.lengths + events, w.max_seq_len)
    return np.asarray(-(-final // BLOCK_SIZE) + 1, dtype=np.int64)


def kv_budget(w: ReferenceWorkload, plan: Plan, geometry: KVCacheConfig) -> tuple[int, int]:
    """(bytes, blocks) for every user at its final (window-capped) length, +1 block each."""
    blocks = int(np.sum(user_blocks(w, plan))) + 64
    return blocks * geometry.bytes_per_block, blocks


def process_kv_budget(
    w: ReferenceWorkload, plan: Plan, geometry: KVCacheConfig, partitions: int, processes: int
) -> tuple[int, int]:
    """(bytes, blocks) for the users of the largest share of partitions one of
    ``processes`` members can get (the range assignor: contiguous, the first members one
    more), so that every process holds its own users at their final lengths."""
    part = np.array([partition_of(f"u{u}".encode(), partitions) for u in range(len(plan.lengths))])
    per_part = np.bincount(part, weights=user_blocks(w, plan), minlength=partitions)
    sizes = [partitions // processes + (i < partitions % processes) for i in range(processes)]
    edges = np.cumsum([0, *sizes])
    blocks = int(max(per_part[lo:hi].sum() for lo, hi in itertools.pairwise(edges))) + 64
    return blocks * geometry.bytes_per_block, blocks
