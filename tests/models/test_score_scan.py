"""Retrieval with the scores written once (models/score_scan.py) against the exact oracle.

- CPU: the plan (segments cover a chunk in whole blocks) and the threshold's promise
  (every top-k item scores above it) on the stress cases.
- Interpreter (``TRITON_INTERPRET=1`` with /work/triton-venv): the scan and merge kernels
  at small shapes with chunks and regions small enough that several chunks run and
  regions compact; scores on a dyadic grid are exact, so the result equals the oracle
  bit for bit, tie order included. The op (``fused_retrieve``) runs this path.
- ``gpu``: the 1M-item checks of test_retrieval.py run the op, hence this path, on CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models.score_scan import chunk_threshold, scan_segments
from tests.models.retrieval_cases import CASES, FIRST, case, oracle
from tests.triton_interpreter import INTERPRET, patch_scalars

INTERPRETER = INTERPRET and importlib.util.find_spec("triton") is not None


def test_segments_cover_a_chunk_in_whole_blocks() -> None:
    # One user: as many programs as asked, but no segment shorter than a block.
    assert scan_segments(1, 262_144, 1024, 528) == (256, 1024)
    # 64 users share 528 programs: 9 segments of whole blocks cover the chunk.
    segments, seg_cols = scan_segments(64, 262_144, 1024, 528)
    assert (segments, seg_cols) == (9, 29_696) and segments * seg_cols >= 262_144
    assert (segments - 1) * seg_cols < 262_144  # no empty segment
    assert scan_segments(1024, 262_144, 1024, 528) == (1, 262_144)
    # A symbolic batch (not an int under export) gets the fixed count.
    assert scan_segments(object(), 262_144, 1024, 528) == (16, 16_384)  # type: ignore[arg-type]
    assert scan_segments(object(), 3_000, 1024, 528) == (3, 1024)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("chunk", [64, 1024])
def test_first_chunk_threshold_passes_every_top_k_item(name: str, chunk: int) -> None:
    users, table, exclude, k = case(name)
    scores = users @ table.t()  # [B, V], exact on the dyadic grid
    thr = chunk_threshold(scores[:, FIRST : FIRST + chunk], k + exclude.shape[1])  # [B]
    top_s, _ = oracle(scores, exclude, k, FIRST)
    finite = torch.isfinite(top_s)  # excluded fill-ins of "tiny" are -inf
    assert bool((top_s > thr[:, None])[finite].all())
    passing = (scores[:, FIRST:] > thr[:, None]).sum(1)
    print(f"{name} chunk {chunk}: candidates per user {passing.tolist()}")


@pytest.fixture
def score_scan(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    if not INTERPRETER:
        pytest.skip("needs TRITON_INTERPRET=1 and Triton (/work/triton-venv)")
    patch_scalars(monkeypatch)
    from streamrec.models import score_scan

    return score_scan


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(
    "dtype,chunk,block,programs",
    [
        (torch.float32, 1024, 16, 6),  # 4 chunks, 2 segments per user, CAP 32: compacts
        (torch.bfloat16, 512, 32, 3),  # 8 chunks, one segment per user
        (torch.bfloat16, 4096, 16, 300),  # one chunk, 64 segments of one block
        (torch.float32, 4096, 1024, 3),  # compactions sort their region in 512-key windows
    ],
)
def test_scan_equals_exact_top_k_on_the_interpreter(
    score_scan, name: str, dtype: torch.dtype, chunk: int, block: int, programs: int
) -> None:  # type: ignore[no-untyped-def]
    users, table, exclude, k = case(name)
    got_s, got_i, counts = score_scan.launch_score_scan(
        users.to(dtype), table.to(dtype), exclude, k, FIRST, chunk, programs, block, 32
    )
    # The scan ranks what mm returns: the exact scores rounded once to the dtype.
    want_s, want_i = oracle((users @ table.t()).to(dtype), exclude, k, FIRST)
    print(f"{name} {dtype}: candidates kept per user {counts.sum(1).tolist()}")
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)


def test_scan_rejects_a_block_that_is_not_a_power_of_two(score_scan) -> None:  # type: ignore[no-untyped-def]
    users, table, exclude, k = case("random")
    with pytest.raises(ModelError, match="block=24"):
        score_scan.launch_score_scan(users, table, exclude, k, FIRST, 1024, 4, 24)
    with pytest.raises(ModelError, match="chunk_items=8"):
        score_scan.launch_score_scan(users, table, exclude, k, FIRST, 8, 4, 16)
