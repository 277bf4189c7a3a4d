"""``extend_scratch`` through AOTInductor on the CPU: a generation package (the entry
points a draft model's package holds) equals eager, and a generator driving it emits
exactly what the eager generator does.

The package is built in the background beside the worker tests, which this module runs
after (aoti_prebuild.py: one process, entry point after entry point, as
``build_package`` does in the process that asks), or here when there was none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models.aoti_export import ExportConfig
from streamrec.models.aoti_runtime import AOTIModel, open_aoti_model
from streamrec.models.checkpoint import load_checkpoint
from streamrec.models.hstu import HSTU
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.generation_workspace import ModelGeometry
from streamrec.pipeline.generator import Generator, GenModel
from tests.models.aoti_fixtures import CACHE_DIR, GENERATION, REL_TOL, rel_err, tiny_model_dir
from tests.pipeline.generation_fixtures import CachedUsers, random_hstu

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("gen") / "tiny")


@pytest.fixture(scope="module")
def compiled(model_dir: Path, generation_prebuilt: None) -> AOTIModel:
    return open_aoti_model(
        model_dir, "cpu", CACHE_DIR, compile_if_missing=True, config=GENERATION, progress=print
    )


@pytest.fixture(scope="module")
def eager(model_dir: Path) -> HSTU:
    return load_checkpoint(model_dir).model


@pytest.mark.parametrize(("lengths", "new", "scratch"), [([5], 1, [0]), ([0, 9, 3], 4, [2, 0, 5])])
@torch.no_grad()
def test_extend_scratch_equals_eager(compiled, eager, lengths, new, scratch) -> None:
    users = CachedUsers(eager, lengths or [1], seed=len(lengths), block_size=4)
    cfg = eager.config
    gen = torch.Generator().manual_seed(new)
    b = len(lengths)
    tables, lens = users.cache.batch_tables(users.users)
    lens = torch.tensor(lengths, dtype=torch.int64)  # a user may have nothing cached
    items = torch.randint(cfg.first_item_row, cfg.num_items, (b, new), generator=gen)
    actions = torch.randint(1, 5, (b, new), generator=gen)
    ts = 1_800_000_000_000 + torch.arange(b * new).view(b, new) * 60_000
    shape = (cfg.num_layers, 2, b, 8, cfg.num_heads, cfg.head_dim)
    scratch_kv = torch.randn(shape, generator=gen)
    scratch_ts = torch.full((b, 8), 1_750_000_000_000, dtype=torch.int64)
    scratch_lens = torch.tensor(scratch, dtype=torch.int64)
    args = (items, actions, ts, users.cache.kv, users.cache.ts, tables, lens, scratch_kv,
            scratch_ts, scratch_lens)  # fmt: skip
    for got, want in zip(compiled.extend_scratch(*args), eager.extend_scratch(*args), strict=True):
        assert got.shape == want.shape and rel_err(got, want) < REL_TOL
    with pytest.raises(ModelError, match="scratch_ts"):
        compiled.extend_scratch(*args[:8], scratch_ts[:, :3], scratch_lens)


def test_generator_on_the_package_emits_what_eager_does(compiled, eager) -> None:
    users = CachedUsers(eager, [4, 11, 1, 7], seed=3, block_size=4)
    geometry = ModelGeometry(eager.config, torch.float32)
    draft = random_hstu(4, num_items=eager.config.num_items, num_layers=1, max_seq_len=24)
    draft_model = GenModel(draft, ModelGeometry(draft.config, torch.float32))
    cfg = GenerationConfig(k=6, gamma=2)
    out = {}
    for name, model in (("eager", eager), ("aoti", compiled)):
        for spec in (None, draft_model):
            gen = Generator(GenModel(model, geometry), users.cache.kv, users.cache.ts, cfg, spec)
            got = gen.generate(users.inputs(gen.window if spec is not None else None))
            out[(name, spec is not None)] = got.items
    for items in out.values():
        np.testing.assert_array_equal(items, out[("eager", False)])
    assert compiled.has("extend_scratch") and not compiled.has("extend")


def test_optional_entry_points_load_when_the_package_has_them(compiled, model_dir) -> None:
    """The worker asks for its serving entry points and, optionally, ``extend_scratch``:
    a package exported with it generates compiled; one without it still opens."""
    only_retrieve = ExportConfig(entry_points=("retrieve",), retrieve_k=8)

    def opened(optional: tuple[str, ...]) -> AOTIModel:
        return open_aoti_model(
            model_dir, "cpu", CACHE_DIR, compile_if_missing=False, config=only_retrieve,
            optional=optional,
        )  # fmt: skip

    assert opened(("extend_scratch",)).has("extend_scratch")
    assert not opened(()).has("extend_scratch")
    assert not opened(("no_such_entry_point",)).has("no_such_entry_point")
