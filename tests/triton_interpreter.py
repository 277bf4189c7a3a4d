"""Running Triton kernels on the CPU interpreter (``TRITON_INTERPRET=1``, /work/triton-venv).

Triton 3.6's interpreter turns a scalar into a shape-[1] array and calls ``int()`` on it
for ``range`` bounds, which numpy 2.4 rejects; ``patch_scalars`` reads its one element
instead, for the duration of a test.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def patch_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda t: int(np.asarray(t.handle.data).ravel()[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
