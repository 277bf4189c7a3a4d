"""A draft that proposes from a catalog of items: its retrieval equals a masked full one,
and speculative output stays the target's whatever the catalog holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.errors import ConfigError, ModelError
from streamrec.models.retrieval import retrieve_reference
from streamrec.pipeline.draft_catalog import (
    DRAFT_ITEMS,
    DraftCatalog,
    load_draft_items,
    save_draft_items,
)
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generator import Generator
from tests.pipeline.generation_fixtures import CachedUsers, gen_model, random_hstu


def test_catalog_retrieval_is_the_full_retrieval_restricted_to_the_catalog() -> None:
    draft = random_hstu(3, num_items=60)
    first = draft.config.first_item_row
    rows = np.array([40, 7, 22, 13, 55, 31, 9, 18], np.int64)
    catalog = DraftCatalog(draft, rows)
    emb = torch.nn.functional.normalize(torch.randn(4, draft.config.d_model), dim=-1)
    exclude = torch.tensor([[7, -1], [40, 13], [-1, -1], [59, 3]])  # 59, 3: not in it
    scores, items = catalog.retrieve(emb, 3, exclude)
    # the reference: every row outside the catalog excluded too
    table = draft.retrieval_table.get(draft.item_emb.weight)
    outside = np.setdiff1d(np.arange(first, draft.config.num_items), rows)
    full_exclude = torch.cat([exclude, torch.from_numpy(outside).expand(4, -1)], dim=1)
    want_scores, want_items = retrieve_reference(emb, table, full_exclude, 3, first)
    assert torch.equal(items, want_items)
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=1e-6)
    assert set(items.flatten().tolist()) <= set(rows.tolist())


def test_speculative_output_with_a_tiny_catalog_is_still_the_targets() -> None:
    target = random_hstu(4, num_layers=2, max_seq_len=48)
    users = CachedUsers(target, [4, 6, 2, 9, 3], seed=4)
    cfg = GenerationConfig(k=9, gamma=3)
    plain = Generator(gen_model(target), users.cache.kv, users.cache.ts, cfg)
    want = plain.generate(users.inputs())
    # the draft is the target: over the whole catalog it is always right on short users
    emitted = want.items.ravel()
    for rows, right in ((np.unique(emitted), True), (np.unique(emitted)[:3], False)):
        catalog = DraftCatalog(target, rows)
        spec = Generator(gen_model(target), users.cache.kv, users.cache.ts, cfg,
                         gen_model(target), draft_catalog=catalog)  # fmt: skip
        got = spec.generate(users.inputs(spec.window))
        np.testing.assert_array_equal(got.items, want.items)
        # a catalog holding every item the target emits loses nothing; three items do
        assert (spec.stats.acceptance_rate == 1.0) == right


def test_draft_items_round_trip_most_emitted_first(tmp_path: Path) -> None:
    path = save_draft_items(tmp_path, np.array([[30, 20, 30], [20, 30, 41]]))
    assert path.name == DRAFT_ITEMS
    assert np.load(path).tolist() == [[30, 3], [20, 2], [41, 1]]
    assert load_draft_items(tmp_path, 2).tolist() == [30, 20]
    with pytest.raises(ModelError, match=r"no draft_items\.npy"):
        load_draft_items(tmp_path / "elsewhere", 2)


def test_bad_catalogs_are_named() -> None:
    model = random_hstu(5, num_items=60)
    with pytest.raises(ModelError, match=r"outside the retrievable rows \[3, 60\)"):
        DraftCatalog(model, np.array([1, 20]))
    with pytest.raises(ConfigError, match=r"draft_catalog = 5: needs generation\.draft_model"):
        GenerationConfig(k=3, draft_catalog=5)
    with pytest.raises(ConfigError, match="draft catalog of 2 items"):
        Generator(gen_model(model), torch.zeros(2, 2, 1, 1, 2, 16), torch.zeros(1, 1),
                  GenerationConfig(k=3, temperature=1.0, sample_pool=8), gen_model(model),
                  draft_catalog=DraftCatalog(model, np.array([10, 11])))  # fmt: skip
