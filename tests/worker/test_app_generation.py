"""The worker with ``[generation]`` on and a draft model, end to end on the dev broker:
every record carries k generated items, the ranked lists still equal the recompute, the
metrics count generated and accepted items, and a draft of another model stops the start."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.cache.history_backends import open_history_store
from streamrec.errors import ModelError
from streamrec.models.checkpoint import load_checkpoint, save_checkpoint
from streamrec.models.draft import draft_meta
from streamrec.models.hstu import HSTU
from streamrec.pipeline.draft_catalog import save_draft_items
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.worker.app import App
from streamrec.worker.model_loader import load_model
from streamrec.worker.serving_stack import build_tiers, serving_generation, serving_scoring
from tests.worker.harness import (
    Topics,
    assert_matches_recompute,
    latest_recommendations,
    make_stream,
    make_topics,
    produce,
    read_topic,
    tiny_model_dir,
    wait_until,
    worker_config,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow]
K = 4


def draft_dir(path: Path, target_dir: Path, of: Path | None = None) -> Path:
    """A random 1-layer draft over the target's vocabulary, recorded as a draft of ``of``."""
    target = load_checkpoint(target_dir)
    torch.manual_seed(5)
    cfg = dataclasses.replace(target.config, num_layers=1)
    meta = {"draft_of": draft_meta(load_checkpoint(of or target_dir))}
    save_checkpoint(path, HSTU(cfg).eval(), target.vocab, meta)
    return path


async def test_generated_items_are_published(broker, unique_topic, tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "tiny")
    draft = draft_dir(tmp_path / "draft", model_dir)
    topics = make_topics(broker, unique_topic)
    bootstrap = broker.bootstrap_servers
    config = dataclasses.replace(
        worker_config(bootstrap, topics, f"g-{uuid.uuid4().hex[:8]}", model_dir),
        generation=GenerationConfig(k=K, gamma=2, draft_model=draft),
    )
    stream = make_stream(topics, 1_500, 80, 0.0, seed=3)
    store = open_history_store("memory://", 64)
    app = App(config, store=store)
    worker = asyncio.create_task(app.run())
    await wait_until(lambda: app.ready or worker.done(), 60, "the worker to be ready")
    await produce(bootstrap, stream.records)
    total = len(stream.records)
    await wait_until(
        lambda: sum(app.stats().committed.values()) == total or worker.done(), 240, "commits"
    )
    app._metrics_route()  # what a /metrics scrape does: sync the stats into the metrics
    generated = app.metrics.sample("streamrec_generated_items_total")
    proposed = app.metrics.sample("streamrec_speculative_proposed_total")
    app.stop()
    assert await asyncio.wait_for(worker, 30) == 0
    records = await read_topic(bootstrap, topics.output)
    latest = latest_recommendations(records)
    assert {u: r.version for u, r in latest.items()} == dict(stream.valid)
    for rec in latest.values():
        assert rec.generated is not None and len(rec.generated) == K
        assert len({item for item, _ in rec.generated}) == K
    histories = await store.get(stream.users)
    assert_matches_recompute(model_dir, config, histories, latest)  # generation wrote nothing
    assert generated == K * len(records)
    assert proposed is not None and proposed > 0


def test_a_draft_of_another_model_stops_the_start(tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "tiny")
    other = tiny_model_dir(tmp_path / "other", seed=1)
    draft = draft_dir(tmp_path / "draft", model_dir, of=other)
    config = dataclasses.replace(
        worker_config("127.0.0.1:1", Topics("pb", "ia", "out", "dlq"), "g", model_dir),
        generation=GenerationConfig(k=K, draft_model=draft),
    )
    loaded = load_model(config.model, config.scoring)
    tiers = build_tiers(config.cache, loaded)
    scoring = serving_scoring(config.scoring, loaded.checkpoint.config)
    with pytest.raises(ModelError, match="distilled from model_version"):
        serving_generation(config, loaded, tiers.cache, scoring)
    plain = dataclasses.replace(config, generation=GenerationConfig())
    assert serving_generation(plain, loaded, tiers.cache, scoring) is None


def test_a_draft_catalog_comes_from_the_drafts_directory(tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "tiny")
    draft = draft_dir(tmp_path / "draft", model_dir)
    config = dataclasses.replace(
        worker_config("127.0.0.1:1", Topics("pb", "ia", "out", "dlq"), "g", model_dir),
        generation=GenerationConfig(k=K, draft_model=draft, draft_catalog=3),
    )
    loaded = load_model(config.model, config.scoring)
    tiers = build_tiers(config.cache, loaded)
    scoring = serving_scoring(config.scoring, loaded.checkpoint.config)
    with pytest.raises(ModelError, match=r"no draft_items\.npy"):  # a draft without rollouts
        serving_generation(config, loaded, tiers.cache, scoring)
    first = loaded.checkpoint.config.first_item_row
    save_draft_items(draft, np.array([first + 4, first + 2, first + 4, first + 9, first + 1]))
    step = serving_generation(config, loaded, tiers.cache, scoring)
    assert step is not None
    catalog = step.generator.draft_catalog
    assert catalog is not None and catalog.size == 3  # the 3 most emitted
    assert catalog.rows[first:].tolist() == [first + 4, first + 1, first + 2]
