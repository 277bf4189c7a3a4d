"""The prefill kernels compiled for the H200 (sm_90a) without a GPU: resources per launch.

Triton's wheel ships ptxas, cuobjdump and nvdisasm, so a kernel can be compiled for
Hopper on any machine: this prints, per launch shape, the registers per thread, the spill
stack, the shared memory (the H200 allows 227 KB per CTA) and the SASS length of the
causal key loop (per warp and tile; a proxy for issue cost, the loop that runs once per
key tile). It is how the default launch of ``streamrec.models.prefill_kernels`` was
chosen before any device time. Needs Triton with its NVIDIA backend (``/work/triton-venv``
here); ~15 s per shape on two cores.

    PYTHONPATH=$PWD /work/triton-venv/bin/python -m bench.kernel_resources
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from streamrec.models import prefill_kernels as pfk

H200 = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ROWS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")


def compile_prefill(launch: tuple[int, ...], dtype: str = "bf16", heads: int = 4,
                    head_dim: int = 128) -> Any:  # fmt: skip
    """The prefill kernel at the HSTU reference shape (N = 4,096, 32 time buckets)."""
    block_m, block_n, warps, stages = launch
    fn = pfk._prefill_kernel
    types = {name: f"*{dtype}" for name in ROWS}
    types.update(ts_ptr="*i64", offsets_ptr="*i64", range_ptr="*fp64", pos_ptr="*fp32",
                 tb_ptr="*fp32", cell_edge_ptr="*fp64", cell_base_ptr="*i32",
                 edges_ptr="*i64")  # fmt: skip
    scalars = {"num_users": "i32", "stride_q": "i32", "stride_k": "i32", "stride_v": "i32",
               "half_scale": "fp32", "inv_divisor": "fp32"}  # fmt: skip
    signature = {name: types.get(name) or scalars.get(name) or "constexpr" for name in fn.arg_names}
    constants = dict(
        H=heads, D=head_dim, NUM_POS=4096, NUM_TIME=32, NUM_CELLS=pfk.NUM_CELLS,
        POS_PAD=pfk.POS_PAD, BLOCK_M=block_m, BLOCK_N=block_n, USER_CHUNK=pfk.USER_CHUNK,
        IEEE=dtype == "fp32", FAST=dtype != "fp32",
    )  # fmt: skip
    aligned = [*types, "stride_q", "stride_k", "stride_v"]  # as Triton specialises them
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=H200, options={"num_warps": warps, "num_stages": stages})


def _loop_lengths(sass: str) -> list[int]:
    """SASS instructions of each loop that issues tensor-core ops (HGMMA), inner loops
    (the time-bias edges) left out: the key loops below and on the diagonal."""
    labels: dict[str, int] = {}
    code: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*);", line)
        if instruction:
            code.append(instruction.group(1))
    loops = []
    for end, op in enumerate(code):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", op)
        if target and labels.get(target.group(1), end) < end:
            loops.append((labels[target.group(1)], end))
    lengths = []
    for start, end in loops:
        if any("HGMMA" in op for op in code[start:end]):
            inner = sum(e - s + 1 for s, e in loops if start < s and e < end)
            lengths.append(end - start + 1 - inner)
    return lengths


def resources(kernel: Any) -> dict[str, object]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [os.path.join(TOOLS, "cuobjdump"), "-res-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        sass = subprocess.run(
            [os.path.join(TOOLS, "nvdisasm"), "-c", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
    regs, stack = (int(found.group(1)), int(found.group(2))) if found else (-1, -1)
    local_ops = sass.count("LDL") + sass.count("STL")
    return {
        "regs": regs, "stack_bytes": stack, "smem_kb": round(kernel.metadata.shared / 1024, 1),
        "key_loop_sass": _loop_lengths(sass)[:1], "local_ops": local_ops,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args(argv)
    for launch in pfk.PREFILL_LAUNCHES:
        try:
            row = resources(compile_prefill(launch, args.dtype))
        except Exception as exc:  # a shape Triton cannot lower
            print(f"{launch}: {type(exc).__name__}: {exc}"[:200])
            continue
        print(
            f"prefill {'x'.join(map(str, launch))}: "
            + ", ".join(f"{k} {v}" for k, v in row.items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
