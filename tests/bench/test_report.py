"""The benches' shared output: the host-speed probe."""

from __future__ import annotations

from bench._report import python_probe_ms


def test_python_probe_times_the_fixed_workload_in_milliseconds() -> None:
    one, five = python_probe_ms(repeats=1), python_probe_ms(repeats=5)
    # 50,000 tuples, a sort and a dict: tens of ms on any host of this project; a fresh
    # interpreter's start-up (~20 ms) is outside the timing, so it is not a floor
    assert 1.0 < one < 2_000.0
    assert 1.0 < five < 2_000.0
