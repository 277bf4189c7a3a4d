"""Generation inside the engine's step, under cache pressure (evictions, host tier,
rebuilds): the ranked lists do not change, every record carries k generated items that
avoid the user's recent items, and speculative output equals target-only output."""

from __future__ import annotations

import numpy as np
import torch

from streamrec.cache.history_backends import open_history_store
from streamrec.pipeline.engine import Engine
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generation_workspace import ModelGeometry
from streamrec.pipeline.generator import Generator, GenModel
from streamrec.pipeline.step_generation import StepGeneration
from streamrec.schemas.recommendation_batch import RecommendationBatch
from tests.pipeline.generation_fixtures import random_hstu
from tests.pipeline.test_engine import BLOCK_SIZE, MAX_SEQ_LEN, _batches, _engine, _model, _stream

K = 5


def _with_generation(engine: Engine, draft=None) -> StepGeneration:
    model = engine.step.model
    cfg = model.config  # type: ignore[attr-defined]
    cache = engine.tiers.cache
    generator = Generator(
        GenModel(model, ModelGeometry(cfg, torch.float32)), cache.kv, cache.ts,  # type: ignore[arg-type]
        GenerationConfig(k=K, gamma=3, time_step_ms=30_000),
        None if draft is None else GenModel(draft, ModelGeometry(draft.config, torch.float32)),
        max_blocks=-(-MAX_SEQ_LEN // BLOCK_SIZE) + 1, max_consumed=5,
    )  # fmt: skip
    generation = StepGeneration(generator, cache)
    engine.step.generation = generation
    return generation


async def _run(engine: Engine, batches) -> list[RecommendationBatch]:
    return [(await engine.process(batch)).output for batch in batches]


async def test_generation_in_the_step_leaves_the_ranking_alone() -> None:
    model, vocab = _model(num_known=120)
    batches = _batches(_stream(900, 60, 120, seed=4), events_per_batch=30)
    draft = random_hstu(9, num_items=model.config.num_items, num_layers=1, d_model=16,
                        max_seq_len=40)  # fmt: skip
    plain, ar, spec = (
        _engine(model, vocab, gpu_blocks=60, host_blocks=80,
                store=open_history_store("memory://", MAX_SEQ_LEN))
        for _ in range(3)
    )  # fmt: skip
    _with_generation(ar)
    speculative = _with_generation(spec, draft)
    outputs = [await _run(e, batches) for e in (plain, ar, spec)]
    assert ar.stats().host_hits > 0 and ar.stats().misses > 60  # evictions and rebuilds
    recent: dict[str, list[str]] = {}
    for batch, base, one, other in zip(batches, *outputs, strict=True):
        for ud in batch.users:  # the step's exclusion window: the user's newest 5 items
            recent[ud.user_id] = (recent.get(ud.user_id, []) + [d.item_id for d in ud.deltas])[-5:]
        np.testing.assert_array_equal(one.item_ids, base.item_ids)  # ranking unchanged
        np.testing.assert_allclose(one.scores, base.scores, rtol=0, atol=1e-6)
        assert base.generated_ids is None and "generated" not in base.wire_maps()[0]
        assert one.generated_ids is not None and one.generated_ids.shape == (len(one), K)
        np.testing.assert_array_equal(other.generated_ids, one.generated_ids)  # type: ignore[arg-type]
        for rec in one.records():
            assert rec.generated is not None and len(rec.generated) == K
            ids = [item for item, _ in rec.generated]
            assert len(set(ids)) == K and not set(ids) & set(recent[rec.user_id])
            assert "generate" in (rec.timings_ms or {})
    stats = speculative.stats
    assert stats.users == sum(len(o) for o in outputs[2]) and stats.tokens == K * stats.users
    assert stats.proposed > 0 and stats.target_calls < ar.step.generation.stats.target_calls  # type: ignore[union-attr]
    assert len(speculative.context or ()) <= 60  # dropped users leave the draft windows
