"""The worker's process-wide interpreter settings, each in a child process (a frozen heap
in the test process would keep every earlier test's garbage)."""

from __future__ import annotations

import subprocess
import sys


def _child(*lines: str) -> str:
    code = "\n".join(lines)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout


def test_freeze_heap_takes_the_started_heap_out_of_full_collections() -> None:
    """``streamrec run``'s worker (``App(freeze_heap=True)``) freezes once started: what
    was alive then (torch, the model, the caches) is no longer traversed by collections."""
    out = _child(
        "import gc, torch",
        "from streamrec.worker.interpreter import freeze_heap",
        "freeze_heap()",
        "print(gc.get_freeze_count(), len(gc.get_objects()))",
    )
    frozen, collectable = map(int, out.split())
    assert frozen > 10_000 and collectable < frozen // 10


def test_the_switch_interval_is_the_workers() -> None:
    out = _child(
        "import sys",
        "from streamrec.worker.interpreter import GIL_SWITCH_INTERVAL_S, set_switch_interval",
        "set_switch_interval()",
        "print(sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S)",
    )
    assert out.strip() == "True"
