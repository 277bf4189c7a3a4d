"""What the worker sets in the Python interpreter it runs in.

``App.run`` is its process's root, so it owns these process-wide settings: the GIL switch
interval always, and a frozen heap where the process is one worker's alone (``streamrec
run``; a test process runs many Apps, and a frozen heap would keep their garbage).
"""

from __future__ import annotations

import gc
import sys
from typing import Final

# The engine thread drops the GIL in CUDA waits and graph replays; taking it back waits for
# the loop to yield it, up to the switch interval (5 ms by default): 0.5 ms bounds that.
GIL_SWITCH_INTERVAL_S: Final = 0.0005


def set_switch_interval() -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def freeze_heap() -> None:
    """Collect once, then put every object alive (torch, the model, the caches' tables, a
    preloaded store) into the collector's permanent generation.

    A full collection traversed those ~200,000 objects every time: a 100-200 ms stop of the
    whole process, event loop and engine thread, on the CPU machine, a few times a minute
    while serving. What is allocated later is still collected; garbage from before is
    never freed.
    """
    gc.collect()
    gc.freeze()
