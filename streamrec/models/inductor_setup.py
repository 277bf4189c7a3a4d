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
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

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


def cpu_isa_probe_skipped(device: torch.device) -> AbstractContextManager[object]:
    """Around ``aoti_load_package`` of a CUDA package: trust /proc/cpuinfo for the CPU's
    vector ISA instead of compiling and ``dlopen``-ing one C++ probe per ISA.

    The loader's first call in a process asks Inductor for the CPU ISA (``pick_vec_isa``)
    only to compare it with the package's metadata and log a mismatch; finding it
    compiles and loads a probe per ISA in subprocesses: 41.8 s of the HSTU-8L worker's
    49.6 s start on the H200 (BENCHMARKS.md, issue 15), 9.3 s on the 2-core CPU machine
    (1.4 s trusted, the same ISA found). ``cpp.vec_isa_ok`` skips the base probe, but
    the AVX-512 bf16 and AMX sub-probes build regardless (torch 2.11; 13.7 s of the
    H200's 34.7 s ``open_packages``, whose Xeon has both), so ``VecISA.check_build``
    answers yes inside this block: each ISA is then decided by the cpuinfo flags
    ``torch.cpu`` reads, as the probe would on a compiler that knows the flags. A CUDA
    package's kernels never run on the CPU's vector units. CPU packages keep the probe:
    their compiled code does, and the answer is cached for the rest of the process.
    """
    if device.type != "cuda":
        return nullcontext()
    return _trusted_cpu_isa()


@contextmanager
def _trusted_cpu_isa() -> Iterator[None]:
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    probe = getattr(cpu_vec_isa.VecISA, "check_build", None)
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        if probe is None:  # another torch: the config switch is all there is
            yield
            return
        cpu_vec_isa.VecISA.check_build = _flags_suffice  # type: ignore[method-assign]
        try:
            yield
        finally:
            cpu_vec_isa.VecISA.check_build = probe  # type: ignore[method-assign]


def _flags_suffice(self: object, code: str) -> bool:
    """``VecISA.check_build`` while a CUDA package loads: every caller asks only after
    the cpuinfo flags said yes (``torch.cpu._is_*_supported``)."""
    return True
