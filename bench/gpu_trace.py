"""What the GPU did during a window of a worker bench run: busy share, top kernels, and a
Chrome trace (CUPTI sees every thread's kernels and copies, the workers' included when
they run in this process)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def gpu_trace(seconds: float, path: Path) -> dict[str, Any]:
    """What the GPU did for ``seconds`` (CUPTI, every thread's kernels and copies): busy
    share of the window (merged kernel/copy intervals), the top kernels, a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(seconds)
    torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, -1.0
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    path.with_suffix(".txt").write_text(table)
    return {
        "trace": path.name, "window_ms": round(window / 1000, 1),
        "gpu_busy_ms": round(busy / 1000, 1),
        "gpu_busy_pct": round(100 * busy / window, 1) if window else 0.0,
        "gpu_events": len(spans),
    }  # fmt: skip
