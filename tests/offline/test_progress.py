"""The progress bar shows elapsed time and the time left (issue 17, item 12)."""

from __future__ import annotations

import io

import pytest

from streamrec.offline import progress
from streamrec.offline.progress import ProgressBar


def test_lines_carry_elapsed_and_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()  # not a terminal: one line per tenth of the way
    bar = ProgressBar(10, "epoch 1/2", out)
    now[0] = 112.0
    bar.update(2, loss=0.5)
    now[0] = 250.0
    bar.update(5, loss=0.25)
    now[0] = 4_000.0
    bar.update(10)
    first, second, last = out.getvalue().splitlines()
    assert first == "epoch 1/2 [####....................] 2/10 12s<48s loss=0.5"
    assert second.split()[4] == "2m30s<2m30s"  # 150 s for 5 of 10 at the same pace
    assert last.split()[4] == "1h05m<0s"
