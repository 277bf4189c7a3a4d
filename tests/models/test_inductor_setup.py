"""Process-wide Inductor settings: the CPU-ISA probe is skipped around CUDA package loads."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config

from streamrec.models.inductor_setup import cpu_isa_probe_skipped


def test_cuda_package_loads_trust_the_cpu_isa_and_restore_the_setting() -> None:
    before = inductor_config.cpp.vec_isa_ok
    with cpu_isa_probe_skipped(torch.device("cuda", 0)):
        assert inductor_config.cpp.vec_isa_ok is True  # no per-ISA compile + dlopen probe
    assert inductor_config.cpp.vec_isa_ok == before


def test_cpu_package_loads_keep_the_probe() -> None:
    before = inductor_config.cpp.vec_isa_ok
    with cpu_isa_probe_skipped(torch.device("cpu")):
        assert inductor_config.cpp.vec_isa_ok == before  # their code runs on those units


def test_cuda_package_loads_answer_the_sub_isa_probes_from_cpuinfo() -> None:
    """The AVX-512 bf16 / AMX sub-probes compile even with ``vec_isa_ok`` (torch 2.11):
    inside the block no probe compiles, and the real one is back after it."""
    from torch._inductor import cpu_vec_isa

    probe = cpu_vec_isa.VecISA.check_build
    with cpu_isa_probe_skipped(torch.device("cuda", 0)):
        assert cpu_vec_isa.VecAVX2().check_build("this is not C++") is True  # no compile
    assert cpu_vec_isa.VecISA.check_build is probe
