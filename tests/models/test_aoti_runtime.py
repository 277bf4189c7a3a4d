"""AOTI backend equals eager (issue 5, acceptance 1): fp32 on CPU, package compiled once.

The session fixture loads the tiny model's four entry points from the repo's
``.streamrec-cache``, compiled there by a background build (aoti_prebuild.py, two entry
points at a time) beside the worker tests, which this module runs after, or here when
there was none (cold 2-4 min on the shared 2-core machine); every later run loads it.
The packages hold no weights: they are bound to the eager model's own tensors (issue
15), which the sharing test below proves by changing one in place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streamrec.errors import ExportError, ModelError
from streamrec.models.aoti_export import package_key
from streamrec.models.aoti_runtime import AOTIModel, load_package, open_aoti_model
from streamrec.models.checkpoint import Checkpoint, load_checkpoint, model_version
from streamrec.models.hstu import HSTU
from streamrec.models.package_cache import PackageCache
from tests.models.aoti_fixtures import (
    CACHE_DIR,
    EXPORT,
    REL_TOL,
    REPO,
    cuda_aoti_model,
    make_batch,
    rel_err,
    tiny_aoti_model,
    tiny_model_dir,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("aoti") / "tiny")


@pytest.fixture(scope="session")
def checkpoint(model_dir: Path) -> Checkpoint:
    return load_checkpoint(model_dir)


@pytest.fixture(scope="session")
def eager(checkpoint: Checkpoint) -> HSTU:
    return checkpoint.model


@pytest.fixture(scope="session")
def compiled(checkpoint: Checkpoint, serving_prebuilt: None) -> Iterator[AOTIModel]:
    model = tiny_aoti_model(checkpoint)  # built in the background beside the worker tests
    mtimes = {p: p.stat().st_mtime_ns for p in model.package_dir.glob("*.pt2")}
    yield model
    # No call of any test recompiled or rewrote the package.
    assert {p: p.stat().st_mtime_ns for p in model.package_dir.glob("*.pt2")} == mtimes


@pytest.fixture
def keep_inductor_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests opening other cache roots must not move the session's inductor cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))


def assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel_err(g, w) < REL_TOL, rel_err(g, w)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8, 13, 16])
def test_all_entry_points_equal_eager(compiled: AOTIModel, eager: HSTU, batch_size: int) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    cached = torch.randint(0, 14, (batch_size,), generator=gen).tolist()
    new = torch.randint(0, 5, (batch_size,), generator=gen).tolist()
    cached[0], new[0] = 4, max(new[0], 1)  # an exact block boundary; T >= 1
    if batch_size > 2:
        cached[1], new[1] = 0, 3  # a user with nothing cached yet
        new[2] = 0  # a user with no new tokens (its user_emb is 0)
    batch = make_batch(eager, cached, new, seed=100 + batch_size)
    with torch.inference_mode():
        assert_close(compiled.extend(*batch.extend_args()), eager.extend(*batch.extend_args()))
        assert_close((compiled.rank(*batch.rank_args()),), (eager.rank(*batch.rank_args()),))
        assert_close(
            compiled.prefill(*batch.extend_args()[:4]), eager.prefill(*batch.extend_args()[:4])
        )
        _, _, user_emb = eager.extend(*batch.extend_args())
        exclude = torch.randint(-1, eager.config.num_items, (batch_size, 4), generator=gen)
        for k in (1, 7, 20):  # within the retrievable rows (the rest score -inf)
            got = compiled.retrieve(user_emb, k, exclude)
            want = eager.retrieve(user_emb, k, exclude)
            assert_close(got[:1], want[:1])
            live = user_emb.abs().sum(-1) > 0  # an all-zero user ties every score
            assert torch.equal(got[1][live], want[1][live])


def test_retrieve_without_exclusions_and_k_bounds(compiled: AOTIModel, eager: HSTU) -> None:
    user_emb = torch.nn.functional.normalize(torch.randn(2, eager.config.d_model), dim=-1)
    none = torch.empty(2, 0, dtype=torch.int64)
    got = compiled.retrieve(user_emb, 5, none)
    assert torch.equal(got[1], eager.retrieve(user_emb, 5, none)[1])
    top = compiled.retrieve_k  # the catalog size: the worker's k=256 is clamped to it
    assert top == eager.config.num_items
    with pytest.raises(ModelError, match=rf"k={top + 1} must be in 1\.\.{top}"):
        compiled.retrieve(user_emb, top + 1, none)


def test_long_prefill_up_to_max_seq_len(compiled: AOTIModel, eager: HSTU) -> None:
    n = eager.config.max_seq_len
    batch = make_batch(eager, [0, 0], [n, 5], seed=7)
    args = batch.extend_args()[:4]
    with torch.inference_mode():
        assert_close(compiled.prefill(*args), eager.prefill(*args))


def test_inputs_are_validated_before_the_graph(compiled: AOTIModel, eager: HSTU) -> None:
    batch = make_batch(eager, [3, 5], [1, 2], seed=3)
    args = list(batch.extend_args())
    bad = {
        3: batch.offsets.int(),  # int32 offsets
        6: batch.tables.long(),  # int64 block tables
        4: batch.kv.double(),  # pool dtype differs from the model
        7: batch.lens[:1],  # cached_lens of the wrong length
    }
    for index, value in bad.items():
        wrong = [*args]
        wrong[index] = value
        with pytest.raises(ModelError):
            compiled.extend(*wrong)
    with pytest.raises(ModelError, match="invalid jagged batch"):
        compiled.extend(*args[:3], torch.tensor([0, 2, 1]), *args[4:])
    with pytest.raises(ModelError, match="invalid jagged batch"):
        compiled.extend(*args[:7], torch.tensor([3, 999]))
    with pytest.raises(ModelError, match="max_seq_len=24"):
        n = 25
        compiled.prefill(*(t.repeat(9)[:n] for t in args[:3]), torch.tensor([0, n]))
    pool3 = batch.kv[:, :, :, :3].contiguous()  # blocks of 3 slots
    with pytest.raises(ModelError, match="block size 3 is not a power of two"):
        compiled.rank(
            torch.ones(2, 1, dtype=torch.int64), batch.lens * 0, pool3,
            args[5][:, :3].contiguous(), batch.tables, batch.lens,
        )  # fmt: skip


def test_packages_read_the_models_own_weights(compiled: AOTIModel, eager: HSTU) -> None:
    """One copy of the weights: a change to the eager module's tensor is seen by AOTI."""
    assert compiled.weights is eager
    names = set(compiled.package_dir.joinpath("manifest.json").read_text().split('"'))
    assert "model.item_emb.weight" in names  # the manifest records what may be bound
    batch = make_batch(eager, [4, 7], [2, 1], seed=21)
    weight = eager.layers[1].uvqk.weight
    saved = weight.detach().clone()
    try:
        with torch.inference_mode():
            before = compiled.extend(*batch.extend_args())[2]
            weight.data.mul_(1.7)
            after = compiled.extend(*batch.extend_args())[2]
            want = eager.extend(*batch.extend_args())[2]
        assert rel_err(after, want) < REL_TOL
        assert rel_err(after, before) > 1e-3  # it did read the changed tensor
    finally:
        weight.data.copy_(saved)


def test_weights_of_another_dtype_are_refused(
    compiled: AOTIModel, eager: HSTU, model_dir: Path
) -> None:
    cpu = torch.device("cpu")
    key = package_key(eager.config, "float32", model_version(model_dir), cpu, EXPORT)
    package = PackageCache(CACHE_DIR).open(key)
    assert package.directory == compiled.package_dir
    with pytest.raises(ExportError, match="was compiled as"):
        load_package(package, cpu, HSTU(eager.config).double().eval())


def test_fresh_process_loads_the_cached_package(
    compiled: AOTIModel, eager: HSTU, model_dir: Path, tmp_path: Path
) -> None:
    batch = make_batch(eager, [6, 0, 9], [2, 3, 1], seed=11)
    with torch.inference_mode():
        want = eager.extend(*batch.extend_args())
    torch.save(batch.extend_args(), tmp_path / "inputs.pt")
    script = (
        "import json, sys, time, torch\n"
        "from streamrec.models.aoti_runtime import open_aoti_model\n"
        "from tests.models.aoti_fixtures import CACHE_DIR, EXPORT\n"
        "start = time.perf_counter()\n"
        "m = open_aoti_model(sys.argv[1], 'cpu', CACHE_DIR, compile_if_missing=False, "
        "config=EXPORT)\n"
        "load_s = time.perf_counter() - start\n"
        "args = torch.load(sys.argv[2])\n"
        "torch.save(m.extend(*args), sys.argv[3])\n"
        "print(json.dumps({'load_s': load_s, 'dir': str(m.package_dir)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), str(tmp_path / "inputs.pt"),
         str(tmp_path / "out.pt")],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["dir"] == str(compiled.package_dir)
    assert_close(tuple(torch.load(tmp_path / "out.pt")), want)


def test_missing_package_raises_export_error(
    model_dir: Path, tmp_path: Path, keep_inductor_env: None
) -> None:
    with pytest.raises(ExportError, match="no AOTI package"):
        open_aoti_model(model_dir, "cpu", tmp_path, compile_if_missing=False, config=EXPORT)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corrupt_package_raises_export_error(
    compiled: AOTIModel, model_dir: Path, tmp_path: Path, keep_inductor_env: None, damage: str
) -> None:
    import shutil

    copy = tmp_path / compiled.package_dir.name
    shutil.copytree(compiled.package_dir, copy)
    target = copy / "extend.pt2"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:1000])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ExportError, match=r"corrupt|unreadable"):
        open_aoti_model(model_dir, "cpu", tmp_path, compile_if_missing=False, config=EXPORT)


@pytest.mark.gpu
def test_all_entry_points_equal_eager_on_cuda(model_dir: Path) -> None:
    """Single-threaded runners bound to the CUDA module's weights, called directly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    on_cpu = load_checkpoint(model_dir).model
    on_cuda = load_checkpoint(model_dir, "cuda")
    eager = on_cuda.model
    compiled = cuda_aoti_model(on_cuda)
    assert compiled.weights is eager
    for batch_size in (1, 5, 16):
        gen = torch.Generator().manual_seed(batch_size)
        cached = torch.randint(0, 14, (batch_size,), generator=gen).tolist()
        new = [max(1, n) for n in torch.randint(0, 5, (batch_size,), generator=gen).tolist()]
        batch = make_batch(on_cpu, cached, new, seed=200 + batch_size).to("cuda")
        with torch.inference_mode():
            pairs = [
                (compiled.extend(*batch.extend_args()), eager.extend(*batch.extend_args())),
                ((compiled.rank(*batch.rank_args()),), (eager.rank(*batch.rank_args()),)),
                (
                    compiled.prefill(*batch.extend_args()[:4]),
                    eager.prefill(*batch.extend_args()[:4]),
                ),
            ]
            user_emb = eager.extend(*batch.extend_args())[2]
            exclude = torch.full((batch_size, 2), -1, dtype=torch.int64, device="cuda")
            got_r, want_r = (
                compiled.retrieve(user_emb, 7, exclude),
                eager.retrieve(user_emb, 7, exclude),
            )
        for got, want in pairs:
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and rel_err(g, w) < 1e-4, (batch_size, rel_err(g, w))
        assert rel_err(got_r[0], want_r[0]) < 1e-4 and torch.equal(got_r[1], want_r[1])
