"""The AOTInductor backend of the ``ServingModel`` protocol (pipeline/serving_model.py).

``AOTIModel`` has the exact signatures and outputs of ``HSTU``'s entry points, so the
engine drives either backend unchanged. A compiled package does not check its inputs
(shared/notes/aoti.md, pitfall 3): a wrong dtype, a short offsets tensor or a pool of
the wrong shape gives garbage or a segfault instead of an error. Every call therefore
checks dtypes, ranks, devices and shapes against the model (metadata only, free) and,
with ``check_values``, the offsets and lengths too (one small device reduction + sync).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamrec.errors import ConfigError, ExportError, ModelError
from streamrec.models.aoti_export import (
    ENTRY_POINTS,
    ExportConfig,
    Progress,
    build_package,
    effective_k,
    package_key,
)
from streamrec.models.checkpoint import CONFIG, load_checkpoint, model_version
from streamrec.models.config import DTYPES, HSTUConfig
from streamrec.models.inductor_setup import configure_inductor
from streamrec.models.package_cache import PackageCache, PackageFiles

Runner = Callable[..., Any]
_I64, _I32 = torch.int64, torch.int32


class AOTIModel:
    """Compiled ``prefill`` / ``extend`` / ``rank`` / ``retrieve`` of one model version."""

    backend = "aoti"

    def __init__(
        self,
        runners: dict[str, Runner],
        config: HSTUConfig,
        dtype: torch.dtype,
        device: torch.device,
        retrieve_k: int,
        package_dir: Path,
        check_values: bool = True,
    ) -> None:
        self._runners = runners
        self.config = config
        self.dtype = dtype
        # "cuda" means the current CUDA device: pin the index so that the input check
        # below accepts tensors on "cuda:0" (torch.device("cuda") != torch.device("cuda:0"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.retrieve_k = retrieve_k
        self.package_dir = package_dir
        self.check_values = check_values

    # ---------------------------------------------------------- entry points

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._tokens("prefill", items, actions, ts)
        self._offsets("prefill", offsets, items.shape[0], self.config.max_seq_len)
        k, v, user_emb = self._runner("prefill")(items, actions, ts, offsets)
        return k, v, user_emb

    def extend(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._tokens("extend", items, actions, ts)
        self._tensor("extend", "offsets", offsets, _I64, 1)
        self._pool("extend", offsets.shape[0] - 1, kv_pool, ts_pool, block_tables, cached_lens)
        self._offsets("extend", offsets, items.shape[0], None, block_tables, ts_pool, cached_lens)
        k, v, user_emb = self._runner("extend")(
            items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens
        )
        return k, v, user_emb

    def rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        self._tensor("rank", "cand_items", cand_items, _I64, 2)
        users, cands = cand_items.shape
        self._pool("rank", users, kv_pool, ts_pool, block_tables, cached_lens)
        self._tensor("rank", "query_ts", query_ts, _I64, 1, users)
        if cands == 0:  # nothing to score; the graph wants C >= 1
            return torch.empty(
                users, 0, self.config.num_tasks, dtype=self.dtype, device=self.device
            )
        if self.check_values:
            capacity = block_tables.shape[1] * ts_pool.shape[1]
            if not bool(((cached_lens >= 0) & (cached_lens <= capacity)).all()):
                raise ModelError(
                    f"rank: cached_lens {cached_lens[:8].tolist()} must lie in 0..{capacity} "
                    f"(block_tables {tuple(block_tables.shape)} x block size {ts_pool.shape[1]})"
                )
        scores: torch.Tensor = self._runner("rank")(
            cand_items, query_ts, kv_pool, ts_pool, block_tables, cached_lens
        )
        return scores

    def retrieve(
        self, user_emb: torch.Tensor, k: int, exclude: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k from a graph compiled for ``retrieve_k``: its sorted prefix is the top-k."""
        if not 0 < k <= self.retrieve_k:
            raise ModelError(
                f"retrieve: k={k} must be in 1..{self.retrieve_k} (the package was compiled "
                "for ExportConfig.retrieve_k; re-export with a larger one)"
            )
        self._tensor("retrieve", "user_emb", user_emb, self.dtype, 2, None, self.config.d_model)
        self._tensor("retrieve", "exclude", exclude, _I64, 2, user_emb.shape[0])
        if exclude.shape[1] == 0:  # E >= 1 in the graph; -1 means "none"
            exclude = torch.full((user_emb.shape[0], 1), -1, dtype=_I64, device=self.device)
        scores, idx = self._runner("retrieve")(user_emb, exclude)  # [B, K] each
        if k == self.retrieve_k:
            return scores, idx
        return scores[:, :k].contiguous(), idx[:, :k].contiguous()

    def _runner(self, name: str) -> Runner:
        runner = self._runners.get(name)
        if runner is None:
            raise ExportError(f"AOTI package {self.package_dir} has no {name!r} entry point")
        return runner

    # ------------------------------------------------------------ validation

    def _tensor(
        self,
        entry: str,
        name: str,
        tensor: torch.Tensor,
        dtype: torch.dtype,
        ndim: int,
        *sizes: int | None,
    ) -> None:
        """dtype, rank, device, contiguity and (where given) the leading sizes."""
        if not isinstance(tensor, torch.Tensor):
            raise ModelError(f"{entry}: {name} must be a tensor, got {type(tensor).__name__}")
        shape = tuple(tensor.shape)
        wrong_size = any(s is not None and s != got for s, got in zip(sizes, shape))
        if tensor.dtype != dtype or tensor.dim() != ndim or wrong_size:
            want = ", ".join("?" if s is None else str(s) for s in sizes) or "…"
            raise ModelError(
                f"{entry}: {name} must be {dtype} with {ndim} dims [{want}], "
                f"got {tensor.dtype} {shape}"
            )
        if tensor.device != self.device:
            raise ModelError(
                f"{entry}: {name} is on {tensor.device}, the package runs on {self.device}"
            )
        if not tensor.is_contiguous():
            raise ModelError(
                f"{entry}: {name} {shape} must be contiguous (strides {tensor.stride()})"
            )

    def _tokens(
        self, entry: str, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor
    ) -> None:
        self._tensor(entry, "items", items, _I64, 1)
        if items.shape[0] == 0:
            raise ModelError(f"{entry}: called with 0 tokens (the engine must skip the call)")
        self._tensor(entry, "actions", actions, _I64, 1, items.shape[0])
        self._tensor(entry, "ts", ts, _I64, 1, items.shape[0])

    def _pool(
        self,
        entry: str,
        users: int,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> None:
        cfg = self.config
        if users < 1:
            raise ModelError(f"{entry}: a batch of {users} users; need B >= 1")
        self._tensor(
            entry, "kv_pool", kv_pool, self.dtype, 6,
            cfg.num_layers, 2, None, None, cfg.num_heads, cfg.head_dim,
        )  # fmt: skip
        self._tensor(entry, "ts_pool", ts_pool, _I64, 2, *kv_pool.shape[2:4])
        self._tensor(entry, "block_tables", block_tables, _I32, 2, users)
        if block_tables.shape[1] == 0:
            raise ModelError(f"{entry}: block_tables {tuple(block_tables.shape)} needs >= 1 column")
        self._tensor(entry, "cached_lens", cached_lens, _I64, 1, users)

    def _offsets(
        self,
        entry: str,
        offsets: torch.Tensor,
        num_tokens: int,
        max_len: int | None,
        block_tables: torch.Tensor | None = None,
        ts_pool: torch.Tensor | None = None,
        cached_lens: torch.Tensor | None = None,
    ) -> None:
        """Offsets 0 … T non-decreasing (+ lengths within bounds): one sync for all checks."""
        self._tensor(entry, "offsets", offsets, _I64, 1)
        if offsets.shape[0] < 2:
            raise ModelError(f"{entry}: offsets has {offsets.shape[0]} entries, need B + 1 >= 2")
        if not self.check_values:
            return
        lens = offsets.diff()
        checks = [offsets[0] == 0, offsets[-1] == num_tokens, (lens >= 0).all()]
        if max_len is not None:
            checks.append((lens <= max_len).all())
        if block_tables is not None and ts_pool is not None and cached_lens is not None:
            capacity = block_tables.shape[1] * ts_pool.shape[1]
            checks.append(((cached_lens >= 0) & (cached_lens <= capacity)).all())
        if bool(torch.stack(checks).all()):
            return
        detail = f"offsets {offsets[:9].tolist()} (T={num_tokens}"
        if max_len is not None:
            detail += f", max_seq_len={max_len}"
        if cached_lens is not None and block_tables is not None and ts_pool is not None:
            detail += (
                f", cached_lens {cached_lens[:8].tolist()} within "
                f"{block_tables.shape[1]}x{ts_pool.shape[1]} slots"
            )
        raise ModelError(
            f"{entry}: invalid jagged batch: {detail}); offsets must start at 0, be "
            "non-decreasing and end at T"
        )


# ------------------------------------------------------------------- loading


def load_package(
    package: PackageFiles, device: torch.device, check_values: bool = True
) -> AOTIModel:
    """Load every ``.pt2`` of a verified package onto ``device``."""
    manifest = package.manifest
    try:
        config = HSTUConfig.from_dict(dict(manifest["model_config"]))
        dtype = DTYPES[str(manifest["key"]["dtype"])]
        retrieve_k = int(manifest["retrieve_k"])
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise ExportError(f"{package.directory}: manifest is incomplete: {exc}") from exc
    index = -1 if device.type == "cpu" else (device.index or 0)
    runners: dict[str, Runner] = {}
    for name, path in package.files.items():
        try:
            runners[name] = torch._inductor.aoti_load_package(str(path), device_index=index)
        except Exception as exc:  # the loader raises RuntimeError, OSError, zip errors ...
            raise ExportError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc
    return AOTIModel(runners, config, dtype, device, retrieve_k, package.directory, check_values)


def read_model_config(model_dir: Path | str) -> HSTUConfig:
    path = Path(model_dir) / CONFIG
    try:
        return HSTUConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, ConfigError) as exc:
        raise ExportError(f"cannot read model config {path}: {exc}") from exc


def open_aoti_model(
    model_dir: Path | str,
    device: str | torch.device,
    cache_dir: Path | str,
    *,
    compile_if_missing: bool,
    dtype: str | None = None,
    config: ExportConfig | None = None,
    progress: Progress | None = None,
    check_values: bool = True,
) -> AOTIModel:
    """The compiled model of ``model_dir`` from the package cache.

    Raises ``ExportError`` when no valid package exists and ``compile_if_missing`` is
    false (the worker then falls back to eager, or stops under ``require_aoti``), or
    when compiling / loading fails.
    """
    config = config or ExportConfig()
    target = torch.device(device)
    model_config = read_model_config(model_dir)
    dtype_name = dtype or model_config.dtype
    if dtype_name not in DTYPES:
        raise ExportError(f"dtype={dtype_name!r} must be one of {sorted(DTYPES)}")
    try:
        version = model_version(model_dir)
    except ModelError as exc:
        raise ExportError(str(exc)) from exc
    root = Path(cache_dir)
    configure_inductor(root)
    key = package_key(model_config, dtype_name, version, target, config)
    cache = PackageCache(root)
    try:
        package = cache.open(key)
    except ExportError:
        if not compile_if_missing:
            raise
        try:
            checkpoint = load_checkpoint(model_dir, device=target, dtype=dtype_name)
        except ModelError as exc:
            raise ExportError(f"cannot export {model_dir}: {exc}") from exc
        package = build_package(checkpoint.model, version, root, config, progress=progress)
        del checkpoint
    missing = sorted(set(ENTRY_POINTS) - set(package.files))
    if missing:
        raise ExportError(f"AOTI package {package.directory} lacks entry point(s) {missing}")
    model = load_package(package, target, check_values)
    if model.retrieve_k != effective_k(model_config, config):
        raise ExportError(
            f"{package.directory}: retrieve_k={model.retrieve_k} disagrees with its key"
        )
    return model
