"""Process-wide settings that AOTInductor reads from the environment, set in one place.

Inductor takes its compile cache, C++ compiler and CPU-ISA probe from environment
variables and module-level config, so they must be fixed before the first compile or
load. Two of them bit us (docs: shared/notes/aoti.md, pitfalls 5 and 6, and the H200
pitfall): the default cache ``/tmp/torchinductor_<user>`` is shared by every process on
the machine, and an image whose ``CXX`` is a wrapper that links libstdc++ statically
produces ``.so`` files that segfault in ``aoti_load_package``.
"""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_CXX = Path("/usr/bin/g++")
# Set to a compiler path to override the choice below (e.g. clang++ on a dev box).
CXX_OVERRIDE_VAR = "STREAMREC_CXX"


def configure_inductor(cache_dir: Path) -> str:
    """Point inductor's caches under ``cache_dir`` and pick the C++ compiler.

    Returns the compiler inductor will use. ``STREAMREC_CXX`` wins; otherwise
    ``/usr/bin/g++`` when it exists (dynamically linked libstdc++, which the loaded
    package shares with torch); otherwise whatever ``CXX`` / inductor's default says.
    """
    import torch._inductor.config as inductor_config

    inductor_dir = cache_dir / "inductor"
    inductor_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir.resolve())
    cxx = os.environ.get(CXX_OVERRIDE_VAR)
    if not cxx and SYSTEM_CXX.exists():
        cxx = str(SYSTEM_CXX)
    if cxx:
        os.environ["CXX"] = cxx
        inductor_config.cpp.cxx = (None, cxx)
    return str(inductor_config.cpp.cxx[1])
