"""The fused kernels compiled for the H200 (sm_90a) without a GPU: resources per launch.

Triton's wheel ships ptxas, cuobjdump and nvdisasm, so a kernel can be compiled for
Hopper on any machine: this prints, per launch shape, the registers per thread, the spill
stack, the shared memory (the H200 allows 227 KB per CTA) and the SASS length of the
causal key loop (per warp and tile; a proxy for issue cost, the loop that runs once per
key tile). It is how the default launch of ``streamrec.models.prefill_kernels`` was
chosen before any device time. Needs Triton with its NVIDIA backend (``/work/triton-venv``
here); ~15 s per shape on two cores.

``--kernel decode``: the decode kernel of ``extend`` (its one-token and tensor-core
bodies in one kernel, ``paged_attention.py``) per launch shape and pool dtype, with the
programs per SM its registers and shared memory allow (the one-token body is
memory-bound: fewer programs per SM, fewer loads in flight); ``--inductor`` types the
symbolic integers and the floats as AOTInductor passes them (int64, fp64). A compile
that fails here (a loop-carried type error, say) fails on the GPU too, where the
interpreter passes it.

    PYTHONPATH=$PWD /work/triton-venv/bin/python -m bench.kernel_resources
    PYTHONPATH=$PWD /work/triton-venv/bin/python -m bench.kernel_resources --kernel decode
    PYTHONPATH=$PWD /work/triton-venv/bin/python -m bench.kernel_resources --kernel scan

``--kernel scan``: the retrieval scan (``score_scan.py``), a memory stream whose bytes in
flight are its programs per SM times the blocks each has loaded ahead.

``--kernel rank``: the candidate kernel of ``rank`` (``candidate_attention.py``) over a
bf16 and an FP8 pool at the sweep's launch shapes.

``--kernel select``: the retrieval select kernel (``retrieval.py``) at 1M x 512 bf16, k =
256, its default loop and its flat loop.

Every row has ``async_copies``: the loads Triton's software pipeliner turned into
asynchronous copies. 0 means every loop waits on each load in place (a loop without a
``tl.dot``, or one whose body holds a bare nested loop, is left alone). And
``wgmma_serialized``: ptxas's C7515 note, under which each tensor-core op of the kernel
waits for the previous one to finish (the prefill kernel's sorted-user mode had it until
the eighteenth session).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from streamrec.models import candidate_attention as ca
from streamrec.models import multi_query_attention as mqa
from streamrec.models import paged_attention as pa
from streamrec.models import prefill_kernels as pfk
from streamrec.models import resident_select as rs
from streamrec.models import retrieval as rt
from streamrec.models import score_scan as ss

H200 = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ROWS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")


def _compile(fn: Any, signature: dict[str, str], constants: dict[str, Any],
             aligned: list[str], options: dict[str, int]) -> Any:  # fmt: skip
    """``fn`` compiled for sm_90a, the ``aligned`` arguments specialised as divisible by 16
    (as Triton specialises pointers and strides at the reference shapes)."""
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=H200, options=options)


def _print_row(label: str, row: dict[str, object]) -> None:
    print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)


def compile_prefill(launch: tuple[int, ...], dtype: str = "bf16", heads: int = 4,
                    head_dim: int = 128,
                    bucket_loop: int = pfk.PREFILL_BUCKET_LOOP, mode: int = 0,
                    tile_range: bool = pfk.PREFILL_TILE_RANGE) -> Any:  # fmt: skip
    """The prefill kernel at the HSTU reference shape (N = 4,096, 32 time buckets)."""
    block_m, block_n, warps, stages = launch
    fn = pfk._prefill_kernel
    types = {name: f"*{dtype}" for name in ROWS}
    types.update(ts_ptr="*i64", offsets_ptr="*i64", range_ptr="*fp64", pos_ptr="*fp32",
                 tb_ptr="*fp32", cell_edge_ptr="*fp64", cell_base_ptr="*i32",
                 edges_ptr="*i64", thr_ptr="*i32", sorted_ptr="*i32")  # fmt: skip
    scalars = {"num_users": "i32", "stride_q": "i32", "stride_k": "i32", "stride_v": "i32",
               "half_scale": "fp32", "inv_divisor": "fp32"}  # fmt: skip
    signature = {name: types.get(name) or scalars.get(name) or "constexpr" for name in fn.arg_names}
    constants = dict(
        H=heads, D=head_dim, NUM_POS=4096, NUM_TIME=32, NUM_CELLS=pfk.NUM_CELLS,
        POS_PAD=pfk.POS_PAD, BLOCK_M=block_m, BLOCK_N=block_n, USER_CHUNK=pfk.USER_CHUNK,
        IEEE=dtype == "fp32", FAST=dtype != "fp32", KV_FP8=False, BUCKET_LOOP=bucket_loop,
        MODE=mode, TILE_RANGE=tile_range, NT_P2=32,
    )  # fmt: skip
    aligned = [*types, "stride_q", "stride_k", "stride_v"]  # as Triton specialises them
    return _compile(fn, signature, constants, aligned, {"num_warps": warps, "num_stages": stages})


# (block_n, warps, acc2d, chunk tokens, chunk key tile[, prefetch[, stages]]): the op's default
# first, then the shapes bench/attention_sweep.py times.
DECODE_LAUNCHES = (
    (pa.DECODE_BLOCK_N, pa.DECODE_WARPS, pa.DECODE_ACC2D, mqa.CHUNK_M, mqa.CHUNK_N),
    (16, 4, True, 16, 16), (64, 4, True, 16, 16), (32, 2, True, 16, 16), (64, 2, False, 16, 16),
    (32, 4, True, 16, 32), (32, 4, True, 32, 16),
    (32, 4, True, 16, 16, True), (16, 4, True, 16, 16, True), (32, 4, False, 16, 16, True),
    (32, 4, True, 16, 16, False, 2), (32, 4, True, 16, 16, False, 3),
    (16, 4, True, 16, 16, False, 3),
)  # fmt: skip
DECODE_INDEX = ("q_pos_ptr", "q_ts_ptr", "q_user_ptr", "q_start_ptr", "ts_pool_ptr", "lens_ptr",
                "edges_ptr")  # fmt: skip
SYMBOLIC = ("num_queries", "max_blocks", "keys_per_split", "ws_stride")


def compile_decode(launch: tuple[Any, ...], dtype: str = "bf16", kv_fp8: bool = False,
                   inductor: bool = False, heads: int = 4, head_dim: int = 128) -> Any:  # fmt: skip
    """The decode kernel at the HSTU-8L reference shape (N = 4,096, 32 time buckets), its
    integer arguments divisible by 16 as at batch 64; ``kv_fp8``: an e4m3 pool."""
    block_n, warps, acc2d, block_m, chunk_n, *rest = launch
    prefetch = bool(rest and rest[0])
    stages = int(rest[1]) if len(rest) > 1 else pa.DECODE_STAGES
    fn = pa._decode_kernel
    kv = "*fp8e4nv" if kv_fp8 else f"*{dtype}"
    types = {name: f"*{dtype}" for name in ("q_ptr", "kn_ptr", "vn_ptr", "pos_bias_ptr",
                                             "time_bias_ptr", "out_ptr")}  # fmt: skip
    floats = "fp64" if inductor else "fp32"  # (Inductor passes Python floats as fp64)
    types.update({name: "*i64" for name in DECODE_INDEX}, k_ptr=kv, v_ptr=kv,
                 tables_ptr="*i32", kv_scale_ptr="*fp32" if kv_fp8 else "*i64",
                 ws_ptr="*fp32", ticket_ptr="*i32", scale=floats, inv_divisor=floats)  # fmt: skip
    symbolic = "i64" if inductor else "i32"
    signature: dict[str, str] = {}
    for p in fn.params:
        ints = symbolic if p.name in SYMBOLIC else "i32"
        signature[p.name] = "constexpr" if p.is_constexpr else types.get(p.name, ints)
    constants = dict(
        H=heads, D=head_dim, NUM_POS=4096, NUM_TIME=32, NT_P2=32, BLOCK_M=block_m,
        BLOCK_N=block_n, CHUNK_N=chunk_n, SCAN=mqa.TOKEN_SCAN, ACC2D=acc2d,
        IEEE=dtype == "fp32", FAST=dtype != "fp32", KV_FP8=kv_fp8, PREFETCH=prefetch,
        STAGES=stages,
    )  # fmt: skip
    aligned = [name for name, kind in signature.items() if kind[0] in "*i"]
    return _compile(fn, signature, constants, aligned, {"num_warps": warps})


def programs_per_sm(row: dict[str, Any], warps: int) -> int:
    """Resident programs per H200 SM: 64K registers (8 per thread granules), 228 KB of
    shared memory (1 KB per block reserved), 64 warps."""
    regs = -(-int(row["regs"]) // 8) * 8
    smem = float(row["smem_kb"]) * 1024 + 1024
    return min(65536 // (regs * 32 * warps), int(233472 // smem), 64 // warps, 32)


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
    with tempfile.TemporaryDirectory() as tmp:  # ptxas -v says when it serializes wgmma
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run(
            [os.path.join(TOOLS, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
    regs, stack = (int(found.group(1)), int(found.group(2))) if found else (-1, -1)
    local_ops = sass.count("LDL") + sass.count("STL")
    # Loads the software pipeliner turned into asynchronous copies (0: the loop waits on
    # every load; a loop with a bare nested loop in its body is left unpipelined).
    ttgir = kernel.asm["ttgir"]
    async_copies = ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy")
    return {
        "regs": regs, "stack_bytes": stack, "smem_kb": round(kernel.metadata.shared / 1024, 1),
        "key_loop_sass": _loop_lengths(sass)[:1], "local_ops": local_ops,
        "async_copies": async_copies,
        # ptxas C7515: every wgmma of the kernel waits for the one before it (a non-wgmma
        # instruction writes an accumulator inside a pipeline stage, e.g. a loop's
        # zero-trip path copying the initial zeros)
        "wgmma_serialized": "C7515" in info.stdout + info.stderr,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--kernel", default="prefill", choices=["prefill", "decode", "scan", "rank", "select"]
    )
    parser.add_argument("--inductor", action="store_true", help="decode: int64 symbolic ints")
    args = parser.parse_args(argv)
    if args.kernel == "decode":
        return decode_main(args.dtype, args.inductor)
    if args.kernel == "scan":
        return scan_main(args.dtype)
    if args.kernel == "rank":
        return rank_main()
    if args.kernel == "select":
        return select_main()
    # mode 0: every user's time bias from timestamps; 1: from key positions ("-thr")
    for launch, mode in [(launch, 0) for launch in pfk.PREFILL_LAUNCHES] + [
        (launch, 1) for launch in pfk.PREFILL_LAUNCHES
    ]:
        try:
            row = resources(compile_prefill(launch, args.dtype, mode=mode))
        except Exception as exc:  # a shape Triton cannot lower
            print(f"{launch} mode {mode}: {type(exc).__name__}: {exc}"[:200])
            continue
        _print_row(f"prefill {'x'.join(map(str, launch))}{'-thr' if mode else ''}", row)
    return 0


def decode_main(dtype: str, inductor: bool) -> int:
    """Every decode launch over a pool of ``dtype`` and (bf16) of FP8 codes."""
    failed = 0
    for kv_fp8 in (False, True) if dtype == "bf16" else (False,):
        for launch in DECODE_LAUNCHES:
            label = f"decode {'x'.join(str(int(v)) for v in launch)} {'fp8' if kv_fp8 else dtype}"
            try:
                row = resources(compile_decode(launch, dtype, kv_fp8, inductor))
            except Exception as exc:  # a compile error the interpreter does not see
                print(f"{label}: {type(exc).__name__}: {exc}"[:2000])
                failed += 1
                continue
            row.pop("key_loop_sass")  # (mma.sync, not the HGMMA loops it counts)
            row["programs_per_sm"] = programs_per_sm(row, int(launch[1]))
            _print_row(label, row)
    return 1 if failed else 0


# (block_m, block_n, warps, stages): the op's default first, then bench/attention_sweep.py's
RANK_LAUNCHES = (
    (ca.CAND_BLOCK_M, ca.CAND_BLOCK_N, ca.CAND_WARPS, ca.CAND_STAGES),
    (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3),
)  # fmt: skip


def compile_rank(launch: tuple[int, ...], kv_fp8: bool = False, heads: int = 4,
                 head_dim: int = 128) -> Any:  # fmt: skip
    """The candidate kernel at the HSTU-8L reference shape, bf16 projections, the q/k/v
    columns of the packed projection activated on load as ``rank`` calls it."""
    block_m, block_n, warps, stages = launch
    fn = ca._candidate_kernel
    kv = "*fp8e4nv" if kv_fp8 else "*bf16"
    types = {name: "*bf16" for name in ("q_ptr", "ks_ptr", "vs_ptr", "pos_bias_ptr",
                                         "time_bias_ptr", "out_ptr")}  # fmt: skip
    types.update(kbias_ptr="*fp32", k_ptr=kv, v_ptr=kv, tables_ptr="*i32", lens_ptr="*i64",
                 kv_scale_ptr="*fp32" if kv_fp8 else "*i64", ws_ptr="*fp32",
                 ticket_ptr="*i32", scale="fp32", inv_divisor="fp32")  # fmt: skip
    signature = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32")
                 for p in fn.params}  # fmt: skip
    constants = dict(H=heads, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=False,
                     FAST=True, KV_FP8=kv_fp8, ACT=True,
                     FP16_DOTS=kv_fp8 and ca.CAND_FP8_FP16_DOTS)  # fmt: skip
    aligned = [name for name, kind in signature.items() if kind[0] in "*i"]
    return _compile(fn, signature, constants, aligned, {"num_warps": warps, "num_stages": stages})


def rank_main() -> int:
    for kv_fp8 in (False, True):
        for launch in RANK_LAUNCHES:
            row = resources(compile_rank(launch, kv_fp8))
            label = f"rank {'x'.join(map(str, launch))} {'fp8' if kv_fp8 else 'bf16'}"
            _print_row(label, row)
    return 0


def compile_select(config: Any, keep: int = 256, dim: int = 512) -> Any:
    """The retrieval select kernel with ``config`` (a ``retrieval.LaunchConfig``) as
    ``launch_retrieval`` runs it for k <= ``keep`` (bf16, strides divisible by 16)."""
    fn = rt._select_kernel
    pointers = dict(u_ptr="*bf16", t_ptr="*bf16", thr_ptr="*fp32", ex_ptr="*i32",
                    cnt_ptr="*i32", sc_ptr="*fp32", ix_ptr="*i32")  # fmt: skip
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32")
                 for p in fn.params}  # fmt: skip
    tiles = rt.FLAT_TILES if config.flat else 1
    constants = dict(D=dim, BLOCK_B=config.block_b, BLOCK_V=config.block_v,
                     BLOCK_K=config.block_k, IEEE=False,
                     CAP=triton.next_power_of_2(keep + tiles * config.block_v), KEEP=keep,
                     FLAT=config.flat, BRANCH=config.branch)  # fmt: skip
    aligned = [*pointers, "stride_u", "stride_t"]
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return _compile(fn, signature, constants, aligned, options)


def compile_resident(config: Any, keep: int = 256, dim: int = 512) -> Any:
    """The resident select kernel (``resident_select.py``) as ``launch_retrieval`` runs it
    with ``config.resident``."""
    fn = rs.resident_select_kernel
    pointers = dict(u_ptr="*bf16", t_ptr="*bf16", thr_ptr="*fp32", ex_ptr="*i32",
                    cnt_ptr="*i32", sc_ptr="*fp32", ix_ptr="*i32")  # fmt: skip
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32")
                 for p in fn.params}  # fmt: skip
    seg, cap = rs.resident_plan(keep, config.block_v)
    constants = dict(D=dim, BLOCK_B=config.block_b, BLOCK_V=config.block_v, IEEE=False,
                     CAP=cap, KEEP=keep, SEG=seg, BRANCH=config.branch)  # fmt: skip
    aligned = [*pointers, "stride_u", "stride_t"]
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return _compile(fn, signature, constants, aligned, options)


# (block_b, block_v, warps, stages) of the resident select at D = 512 (bench/retrieval_bench.py)
RESIDENT_LAUNCHES = ((128, 32, 8, 3), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 4))


def select_main() -> int:
    for bb, bv, warps, stages in RESIDENT_LAUNCHES:
        cfg = rt.LaunchConfig(bb, bv, 64, warps, stages, 1, branch=True, resident=True)
        row = resources(compile_resident(cfg))
        row["programs_per_sm"] = programs_per_sm(row, warps)
        _print_row(f"select B{bb} V{bv} w{warps} s{stages} resident branch", row)
    for config in (rt.default_config(256, torch.bfloat16, 512),
                   rt.default_config(64, torch.bfloat16, 512)):  # fmt: skip
        for flat, branch in ((False, True), (False, False), (True, True), (True, False)):
            cfg = dataclasses.replace(config, flat=flat, branch=branch)
            row = resources(compile_select(cfg))
            label = (f"select B{cfg.block_b} V{cfg.block_v} K{cfg.block_k} w{cfg.num_warps} "
                     f"s{cfg.num_stages}{' flat' * flat}{' branch' * branch}")  # fmt: skip
            _print_row(label, row)
    return 0


def compile_scan(keep: int, dtype: str = "bf16") -> Any:
    """The retrieval scan kernel (``score_scan.py``) as the op launches it for k <= keep."""
    fn = ss._scan_kernel
    pointers = dict(s_ptr=f"*{dtype}", thr_ptr="*fp32", cnt_ptr="*i32", sc_ptr="*fp32",
                    ix_ptr="*i32", ex_ptr="*i32")  # fmt: skip
    signature = {n: "constexpr" if n.isupper() else pointers.get(n, "i32") for n in fn.arg_names}
    block = ss.SCAN_BLOCK
    constants = dict(BLOCK=block, CAP=keep + block, KEEP=keep, WIN=max(ss.COMPACT_WINDOW, keep))
    aligned = [*pointers, "num_cols", "seg_cols", "stride_ex"]  # as at 1M items, E = 16
    return _compile(fn, signature, constants, aligned, {"num_warps": ss.SCAN_WARPS})


def scan_main(dtype: str) -> int:
    """The scan at k = 1 (greedy generation), 256 (the worker) and 1024 (the most)."""
    for keep in (2, 256, 1024):
        row = resources(compile_scan(keep, dtype))
        row.pop("key_loop_sass")
        row["programs_per_sm"] = programs_per_sm(row, ss.SCAN_WARPS)
        _print_row(f"scan keep {keep} {dtype}", row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
