"""The consumer-group rebalance listener: where partitions are handed over.

aiokafka awaits these coroutines inside the rebalance, before the group moves on, so
whatever ``on_partitions_revoked`` finishes (drain, flush, commit, cache drop) is done
before another member can start on those partitions. That is what makes a hand-over lose
nothing and cache no user twice; the drain is bounded so a stuck batch cannot stall the
whole group beyond ``max_poll_interval_ms``.

The listener only adapts aiokafka's interface; the hand-over itself is the ``App``'s,
through the ``Partitions`` protocol, so it can be tested without a consumer group.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Protocol

from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import TopicPartition

log = logging.getLogger(__name__)


class Partitions(Protocol):
    """What happens to the worker's state when partitions come and go."""

    async def partitions_revoked(self, tps: Set[tuple[str, int]]) -> None: ...

    async def partitions_assigned(self, tps: Set[tuple[str, int]]) -> None: ...


class RebalanceListener(ConsumerRebalanceListener):
    def __init__(self, target: Partitions) -> None:
        self._target = target

    async def on_partitions_revoked(self, revoked: Set[TopicPartition]) -> None:
        tps = {(tp.topic, tp.partition) for tp in revoked}
        log.info("partitions revoked", extra={"partitions": sorted(tps)})
        await self._target.partitions_revoked(tps)

    async def on_partitions_assigned(self, assigned: Set[TopicPartition]) -> None:
        tps = {(tp.topic, tp.partition) for tp in assigned}
        log.info("partitions assigned", extra={"partitions": sorted(tps)})
        await self._target.partitions_assigned(tps)
