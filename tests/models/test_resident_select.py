"""The resident select's launch plan (``resident_select.py``, ``retrieval.resident_config``):
what fits one Hopper CTA's shared memory, and how often a program checks its regions.
The kernels themselves are checked in test_retrieval.py (interpreter and GPU)."""

from __future__ import annotations

import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models.resident_select import SHARED_BYTES, check_resident_fits, resident_plan
from streamrec.models.retrieval import resident_config


def test_a_run_between_two_checks_fits_the_room_past_keep() -> None:
    assert resident_plan(256, 32) == (8, 512)  # k = 256: 8 tiles of 32 past the 256 kept
    assert resident_plan(2, 32) == (15, 512)  # k = 1 (the verify): 15 tiles of 32
    assert resident_plan(1024, 128) == (8, 2048)
    for keep, block_v in ((2, 16), (256, 32), (512, 64), (1024, 256)):
        seg, cap = resident_plan(keep, block_v)
        assert seg >= 1 and keep + seg * block_v <= cap and cap & (cap - 1) == 0


def test_the_users_tile_and_its_item_stages_must_fit_one_cta() -> None:
    check_resident_fits(128, 32, 3, 512, 2)  # 224 KB: fits
    with pytest.raises(ModelError, match=r"need 262144 B of shared memory, more than 232448"):
        check_resident_fits(128, 64, 2, 512, 2)
    with pytest.raises(ModelError, match="power-of-two dim, got 96"):
        check_resident_fits(64, 32, 2, 96, 2)
    assert SHARED_BYTES == 227 * 1024


def test_resident_config_picks_the_widest_item_tile_that_fits() -> None:
    big = resident_config(256, torch.bfloat16, 512)
    assert big is not None and big.resident and big.branch
    assert (big.block_b, big.block_v, big.num_stages, big.num_warps) == (128, 32, 3, 8)
    small = resident_config(64, torch.bfloat16, 512)  # one tile of 64: the table read once
    assert small is not None
    assert (small.block_b, small.block_v, small.num_stages, small.num_warps) == (64, 64, 2, 4)
    draft = resident_config(64, torch.float16, 64)  # a draft's D = 64
    assert draft is not None and (draft.block_v, draft.num_stages) == (128, 3)
    exported = resident_config(object(), torch.bfloat16, 512)  # type: ignore[arg-type]
    assert exported is not None and exported.block_b == 128  # a symbolic batch (export)
    assert resident_config(256, torch.float32, 512) is None  # IEEE dots: twice the bytes
    assert resident_config(256, torch.bfloat16, 96) is None
