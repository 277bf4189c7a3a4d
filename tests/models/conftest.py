"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import patch_scalars


@pytest.fixture
def interpreter_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scalar kernel arguments the Triton interpreter can take as range bounds
    (tests/triton_interpreter.py)."""
    patch_scalars(monkeypatch)
