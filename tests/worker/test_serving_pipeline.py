"""The overlapped pipeline (prepare n+1 / execute n / publish n-1) against the real broker
and Redis: a revoke that lands while batches are in flight, per-user order, offsets."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from pathlib import Path

import pytest
import torch

from streamrec.cache.history_backends import open_history_store
from streamrec.pipeline.serving_model import ServingModel
from streamrec.worker.app import App
from streamrec.worker.model_loader import LoadedModel, load_model
from tests.worker.harness import (
    Published,
    assert_end_state,
    committed_offsets,
    end_offsets,
    make_stream,
    make_topics,
    produce,
    start_app,
    tiny_model_dir,
    wait_until,
    worker_config,
)

pytestmark = [pytest.mark.broker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("pipeline") / "tiny")


class SlowSteps:
    """Fault injection: every ``extend`` takes ``delay_s`` longer (on the engine thread),
    so the next batch is prepared and waiting while one executes."""

    def __init__(self, model: ServingModel, delay_s: float) -> None:
        self.model = model
        self.delay_s = delay_s

    def prefill(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model.prefill(*args)  # type: ignore[arg-type]

    def extend(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.model.extend(*args)  # type: ignore[arg-type]

    def rank(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model.rank(*args)  # type: ignore[arg-type]

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.retrieve(user_emb, k, exclude)


async def test_a_revoke_with_batches_in_flight_loses_and_duplicates_nothing(
    broker, unique_topic, model_dir, redis_url, caplog
) -> None:
    """Worker A serves alone with slow steps; worker B joins mid-stream, so A's revoke of
    half its partitions lands while A has a batch executing and the next one prepared.
    Every event is applied once, in order, every offset committed, and every user's last
    list equals the recompute of its history."""
    caplog.set_level(logging.INFO, logger="streamrec.worker.checkpoint")
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    group = f"g-{uuid.uuid4().hex[:8]}"
    prefix = f"streamrec-test-{uuid.uuid4().hex[:10]}"
    config = worker_config(bootstrap, topics, group, model_dir, f"{redis_url}?prefix={prefix}")
    stream = make_stream(topics, 3_000, 120, 0.0, seed=51)
    total = len(stream.records)
    loaded = await asyncio.to_thread(load_model, config.model, config.scoring)
    slow = SlowSteps(loaded.model, delay_s=0.02)
    store = open_history_store(config.store.url, 64)
    published = Published()
    first = App(
        config,
        model=LoadedModel(loaded.checkpoint, slow, loaded.backend, loaded.device),
        store=store,
        on_published=published,
    )
    second: App | None = None
    try:
        first_run = await start_app(first)
        producer = asyncio.create_task(produce(bootstrap, stream.records, rate=1_500))
        await wait_until(lambda: first.stats().published > 200, 60, "the first worker serving")
        second = App(config, store=store, on_published=published)
        second_run = await start_app(second)
        await producer
        ends = await end_offsets(bootstrap, [topics.playback, topics.interaction])
        assert sum(ends.values()) == total

        async def all_committed() -> bool:
            return await committed_offsets(bootstrap, group, sorted(ends)) == ends

        await wait_until(all_committed, 120, "every offset committed by the two workers")
        histories = await store.get(stream.users)
        for app in (first, second):
            app.stop()
        assert await asyncio.wait_for(first_run, 30) == 0
        assert await asyncio.wait_for(second_run, 30) == 0
    finally:
        for app in (first, second):
            if app is not None:
                app.stop()
        await store.delete(stream.users)
        await store.close()

    assert first.pipeline is not None
    traces = list(first.pipeline.stats.traces)
    overlapped = sum(b.prepared < a.executed for a, b in itertools.pairwise(traces))
    assert overlapped > 0, "no batch was prepared while the previous one executed"
    released = first.batcher.stats()  # behind a running step by time, to an idle engine at once
    assert released.released_by_time > 0 and released.released_by_idle > 0
    # Never more than two batches taken and not executed: with 20 ms steps the rest waited
    # (and coalesced) in the batcher.
    pending = [sum(a.released <= b.released < a.executed for a in traces) for b in traces]
    assert max(pending) == 2
    hand_overs = [r for r in caplog.records if r.getMessage() == "hand-over done"]
    assert hand_overs, "the first worker never handed partitions over"
    assert first.stats().rebalances >= 2 and second.stats().published > 0
    assert_end_state(model_dir, config, stream.valid, histories, published.latest, order=stream.ts)
