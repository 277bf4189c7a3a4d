"""The worker's process-wide interpreter settings."""

from __future__ import annotations

import subprocess
import sys


def test_freeze_heap_takes_the_started_heap_out_of_full_collections() -> None:
    """``streamrec run``'s worker (``App(freeze_heap=True)``) freezes once started: what
    was alive then (torch, the model, the caches) is no longer traversed by collections.
    In a child process: a frozen test process would keep every earlier test's garbage."""
    code = (
        "import gc, torch\n"
        "from streamrec.worker.interpreter import freeze_heap\n"
        "freeze_heap()\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, collectable = map(int, out.stdout.split())
    assert frozen > 10_000 and collectable < frozen // 10


def test_the_switch_interval_is_the_workers() -> None:
    code = (
        "import sys\n"
        "from streamrec.worker.interpreter import GIL_SWITCH_INTERVAL_S, set_switch_interval\n"
        "set_switch_interval()\n"
        "print(sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
