"""Where a Triton kernel test runs: the GPU, or the CPU interpreter at small shapes.

The same ``gpu``-marked tests check every kernel on the H200 and, with
``TRITON_INTERPRET=1`` and the Triton venv, on the CPU (fp32; see
``tests/triton_interpreter.py`` for the interpreter's scalar patch).
"""

from __future__ import annotations

import pytest
import torch

from streamrec.models.paged_attention import triton_available
from tests.triton_interpreter import INTERPRET, patch_scalars


def kernel_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """ "cuda" on the GPU machine, "cpu" under the (patched) interpreter, else skip."""
    if torch.cuda.is_available():
        return "cuda"
    if INTERPRET and triton_available():
        patch_scalars(monkeypatch)
        return "cpu"
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with Triton installed)")
