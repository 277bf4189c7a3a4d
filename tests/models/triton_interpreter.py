"""Run the Triton kernels on the CPU interpreter (``TRITON_INTERPRET=1``) in tests.

The kernels are checked here at small fp32 shapes before any GPU run. Triton 3.6's
interpreter holds scalars as one-element arrays and converts them with ``int(array)``,
which NumPy >= 2.4 refuses for arrays of rank 1 (every ``range`` over a loaded bound
fails); ``patch_scalar_index`` makes that conversion take the single element instead.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch


def interpreting() -> bool:
    """True when Triton is imported and runs kernels on the CPU interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def patch_scalar_index() -> None:
    """Make the interpreter's tensor ``__index__`` accept one-element arrays."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_streamrec_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    patched._streamrec_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def kernel_device() -> str:
    """Where a kernel test runs: "cuda" on the GPU machine, "cpu" under the interpreter
    (patched), else the test is skipped."""
    if torch.cuda.is_available():
        return "cuda"
    if interpreting():
        patch_scalar_index()
        return "cpu"
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with Triton installed)")
