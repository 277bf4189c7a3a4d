"""Triton and its language module where this torch build ships them (CUDA builds do; the
CPU build of the CI machine does not), else ``None``: each kernel module defines its
kernels under ``if triton is not None`` and keeps a torch path for the CPU."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on the CPU CI machine
    triton = None
    tl = None

__all__ = ["tl", "triton"]
