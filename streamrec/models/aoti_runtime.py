"""The AOTInductor backend of the ``ServingModel`` protocol (pipeline/serving_model.py).

``AOTIModel`` has the exact signatures and outputs of ``HSTU``'s entry points, so the
engine drives either backend unchanged. Three choices shape it:

- **Weights bound at load.** The packages hold no weights (aoti_export.py); each
  runner is given the tensors of the model loaded from the model directory
  (``load_constants(..., user_managed=True)``: pointers, no copy). All packages of a
  model and the eager fallback share that one copy; the ``AOTIModel`` keeps the module
  alive, and a runner is never called before its constants are bound (it would read
  null pointers).
- **Single-threaded runners.** Packages load with ``run_single_threaded=True``. The
  default runner cannot be captured in a CUDA graph ("operation not permitted when stream
  is capturing", in every capture mode, on the H200 with torch 2.11); the single-threaded
  one captures and replays exactly, and its direct call is cheaper too (a small MLP: 13 µs
  replayed against 56–82 µs called). One caller at a time: the engine thread.
- **Inputs checked on the host.** A compiled package does not check its inputs
  (shared/notes/aoti.md, pitfall 3): a wrong dtype, a short offsets tensor or a pool of
  the wrong shape gives garbage or a segfault instead of an error. Every call checks
  dtypes, ranks, devices and shapes (metadata only, free) and, with ``check_values``,
  the offsets and lengths too, with one small device-to-host copy. That copy
  synchronises, which a CUDA-graph capture forbids, so ``GraphedModel`` calls
  ``check_extend`` / ``check_rank`` on the caller's tensors before each replay and
  captures ``unchecked()``, the same runners without the value checks. The worker loads
  its packages without the value checks (``check_values=False``, worker/model_loader.py):
  before each replay that sync stalled the CPU until the GPU drained, and the worker's
  values come from its own block pool, trusted as the eager kernels trust them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from streamrec.errors import ConfigError, ExportError, ModelError
from streamrec.models.aoti_export import (
    CONSTANT_PREFIX,
    ExportConfig,
    Progress,
    build_package,
    derived_constant,
    effective_k,
    package_key,
    read_model_config,
    tensor_dtype_label,
)
from streamrec.models.checkpoint import Checkpoint, load_checkpoint
from streamrec.models.config import DTYPES, HSTUConfig
from streamrec.models.inductor_setup import configure_inductor, cpu_isa_probe_skipped
from streamrec.models.package_cache import PackageCache, PackageFiles, PackageLease
from streamrec.models.quantization import apply_precision, kv_storage_dtype, model_precision
from streamrec.models.serving_precision import ServingPrecision

Runner = Callable[..., Any]
_I64, _I32 = torch.int64, torch.int32


def pinned(device: torch.device) -> torch.device:
    """ "cuda" means the current CUDA device: pin the index so that the input checks accept
    tensors on "cuda:0" (``torch.device("cuda") != torch.device("cuda:0")``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
        weights: nn.Module | None = None,
        check_values: bool = True,
        lease: PackageLease | None = None,
        kv_dtype: torch.dtype | None = None,
        derived: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self._runners = runners
        # Tensors bound to the runners that are not ``weights``' own (``derived_constant``):
        # the runners hold pointers only, so this keeps them alive as long as the runners.
        self._derived = dict(derived or {})
        self.config = config
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype  # the pool's dtype
        self.device = pinned(device)
        self.retrieve_k = retrieve_k
        self.package_dir = package_dir
        self.weights = weights  # the module whose tensors the runners read: keep it alive
        self.check_values = check_values
        self.lease = lease  # held while serving: the package cache will not evict it

    def unchecked(self) -> AOTIModel:
        """The same runners without the value checks (no host sync: capturable)."""
        return AOTIModel(
            self._runners, self.config, self.dtype, self.device, self.retrieve_k,
            self.package_dir, self.weights, check_values=False, lease=self.lease,
            kv_dtype=self.kv_dtype, derived=self._derived,
        )  # fmt: skip

    # ---------------------------------------------------------- entry points

    def prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.check_prefill(items, actions, ts, offsets)
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
        self.check_extend(items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens)
        k, v, user_emb = self._runner("extend")(
            items, actions, ts, offsets, kv_pool, ts_pool, block_tables, cached_lens
        )
        return k, v, user_emb

    def extend_scratch(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        scratch_kv: torch.Tensor,
        scratch_ts: torch.Tensor,
        scratch_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.check_extend_scratch(
            items, actions, ts, kv_pool, ts_pool, block_tables, cached_lens, scratch_kv,
            scratch_ts, scratch_lens,
        )  # fmt: skip
        k, v, emb = self._runner("extend_scratch")(
            items, actions, ts, kv_pool, ts_pool, block_tables, cached_lens, scratch_kv,
            scratch_ts, scratch_lens,
        )  # fmt: skip
        return k, v, emb

    def rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> torch.Tensor:
        self.check_rank(cand_items, query_ts, kv_pool, ts_pool, block_tables, cached_lens)
        users, cands = cand_items.shape
        if cands == 0:  # nothing to score; the graph wants C >= 1
            return torch.empty(
                users, 0, self.config.num_tasks, dtype=self.dtype, device=self.device
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

    def has(self, entry_point: str) -> bool:
        """Whether the package holds ``entry_point`` (``extend_scratch`` is optional)."""
        return entry_point in self._runners

    def _runner(self, name: str) -> Runner:
        runner = self._runners.get(name)
        if runner is None:
            raise ExportError(f"AOTI package {self.package_dir} has no {name!r} entry point")
        return runner

    # ------------------------------------------------------------ validation

    def check_prefill(
        self, items: torch.Tensor, actions: torch.Tensor, ts: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """``ModelError`` unless ``prefill`` may run on these tensors."""
        self._tokens("prefill", items, actions, ts)
        self._offsets("prefill", offsets)
        if self.check_values:
            self._values("prefill", offsets, items.shape[0], self.config.max_seq_len)

    def check_extend(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        offsets: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> None:
        """``ModelError`` unless ``extend`` may run on these tensors."""
        self._tokens("extend", items, actions, ts)
        self._offsets("extend", offsets)
        self._pool("extend", offsets.shape[0] - 1, kv_pool, ts_pool, block_tables, cached_lens)
        if self.check_values:
            capacity = block_tables.shape[1] * ts_pool.shape[1]
            self._values("extend", offsets, items.shape[0], None, cached_lens, capacity)

    def check_rank(
        self,
        cand_items: torch.Tensor,
        query_ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
    ) -> None:
        """``ModelError`` unless ``rank`` may run on these tensors."""
        self._tensor("rank", "cand_items", cand_items, _I64, 2)
        users = cand_items.shape[0]
        self._pool("rank", users, kv_pool, ts_pool, block_tables, cached_lens)
        self._tensor("rank", "query_ts", query_ts, _I64, 1, users)
        if self.check_values:
            capacity = block_tables.shape[1] * ts_pool.shape[1]
            self._values("rank", None, 0, None, cached_lens, capacity)

    def check_extend_scratch(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        ts: torch.Tensor,
        kv_pool: torch.Tensor,
        ts_pool: torch.Tensor,
        block_tables: torch.Tensor,
        cached_lens: torch.Tensor,
        scratch_kv: torch.Tensor,
        scratch_ts: torch.Tensor,
        scratch_lens: torch.Tensor,
    ) -> None:
        """``ModelError`` unless ``extend_scratch`` may run on these tensors."""
        cfg, entry = self.config, "extend_scratch"
        self._tensor(entry, "items", items, _I64, 2)
        users, new = items.shape
        if new == 0:
            raise ModelError(f"{entry}: called with 0 tokens per user")
        for name, tensor in (("actions", actions), ("ts", ts)):
            self._tensor(entry, name, tensor, _I64, 2, users, new)
        self._pool(entry, users, kv_pool, ts_pool, block_tables, cached_lens)
        self._tensor(
            entry, "scratch_kv", scratch_kv, self.dtype, 6,
            cfg.num_layers, 2, users, None, cfg.num_heads, cfg.head_dim,
        )  # fmt: skip
        self._tensor(entry, "scratch_ts", scratch_ts, _I64, 2, users)
        if scratch_ts.shape[1] != scratch_kv.shape[3] or scratch_ts.shape[1] == 0:
            raise ModelError(
                f"{entry}: scratch_ts {tuple(scratch_ts.shape)} must have the "
                f"{scratch_kv.shape[3]} (>= 1) slots of scratch_kv"
            )
        self._tensor(entry, "scratch_lens", scratch_lens, _I64, 1, users)
        if self.check_values:
            capacity = block_tables.shape[1] * ts_pool.shape[1]
            self._values(entry, None, 0, None, cached_lens, capacity)

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

    def _offsets(self, entry: str, offsets: torch.Tensor) -> None:
        self._tensor(entry, "offsets", offsets, _I64, 1)
        if offsets.shape[0] < 2:
            raise ModelError(f"{entry}: offsets has {offsets.shape[0]} entries, need B + 1 >= 2")

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
            entry, "kv_pool", kv_pool, self.kv_dtype, 6,
            cfg.num_layers, 2, None, None, cfg.num_heads, cfg.head_dim,
        )  # fmt: skip
        self._tensor(entry, "ts_pool", ts_pool, _I64, 2, *kv_pool.shape[2:4])
        block_size = kv_pool.shape[3]
        if block_size & (block_size - 1):  # (the kernels shift and mask: check_pow2_blocks)
            raise ModelError(f"{entry}: kv_pool block size {block_size} is not a power of two")
        self._tensor(entry, "block_tables", block_tables, _I32, 2, users)
        if block_tables.shape[1] == 0:
            raise ModelError(f"{entry}: block_tables {tuple(block_tables.shape)} needs >= 1 column")
        self._tensor(entry, "cached_lens", cached_lens, _I64, 1, users)

    def _values(
        self,
        entry: str,
        offsets: torch.Tensor | None,
        num_tokens: int,
        max_len: int | None,
        cached_lens: torch.Tensor | None = None,
        capacity: int = 0,
    ) -> None:
        """Offsets 0 … T non-decreasing (each length within ``max_len``) and cached
        lengths within the block tables' capacity, checked on the host after one copy."""
        parts = [t for t in (offsets, cached_lens) if t is not None]
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()  # one sync
        problems = []
        if offsets is not None:
            offs = host[: offsets.shape[0]]
            lens = np.diff(offs)
            if offs[0] != 0 or offs[-1] != num_tokens or (lens < 0).any():
                problems.append(
                    f"offsets {offs[:9].tolist()} must start at 0, be non-decreasing and end "
                    f"at T={num_tokens}"
                )
            elif max_len is not None and (lens > max_len).any():
                problems.append(f"a user has {int(lens.max())} tokens > max_seq_len={max_len}")
        if cached_lens is not None:
            cached = host[-cached_lens.shape[0] :]
            if ((cached < 0) | (cached > capacity)).any():
                problems.append(
                    f"cached_lens {cached[:8].tolist()} must lie in 0..{capacity} (the block "
                    "tables' width x block size)"
                )
        if problems:
            raise ModelError(f"{entry}: invalid jagged batch: {'; '.join(problems)}")


# ------------------------------------------------------------------- loading


def _bind_weights(
    runner: Any, path: Path, weights: nn.Module, specs: dict[str, Any], device: torch.device
) -> dict[str, torch.Tensor]:
    """Point the runner's constants at ``weights``' tensors (checked against the manifest);
    returns the derived ones (``derived_constant``), which the caller must keep alive."""
    named = dict(weights.named_parameters()) | dict(weights.named_buffers())
    bound: dict[str, torch.Tensor] = {}
    derived: dict[str, torch.Tensor] = {}
    for fqn in runner.get_constant_fqns():
        with torch.no_grad():  # the model's cached copy, not a fresh autograd result
            tensor = derived_constant(weights, fqn)
        if tensor is not None:
            derived[fqn] = tensor
        else:
            tensor = named.get(fqn.removeprefix(CONSTANT_PREFIX))
        spec = specs.get(fqn)
        if tensor is None or spec is None:
            raise ExportError(f"{path}: needs constant {fqn!r}, which the model does not have")
        got = {"shape": list(tensor.shape), "dtype": tensor_dtype_label(tensor.dtype)}
        if got != spec or tensor.device != device or not tensor.is_contiguous():
            raise ExportError(
                f"{path}: constant {fqn!r} was compiled as {spec}, the model has {got} on "
                f"{tensor.device} (contiguous={tensor.is_contiguous()})"
            )
        bound[fqn] = tensor.detach()
    try:
        runner.load_constants(bound, check_full_update=True, user_managed=True)
    except TypeError:  # a torch without user-managed constants: the runner keeps a copy
        runner.load_constants(bound, check_full_update=True)
    return derived


def load_package(
    package: PackageFiles,
    device: torch.device,
    weights: nn.Module,
    check_values: bool = True,
    entry_points: tuple[str, ...] | None = None,
    lease: PackageLease | None = None,
) -> AOTIModel:
    """Load the ``.pt2`` files of a verified package onto ``device``, bound to ``weights``
    (the model in the package's dtype on ``device``); ``entry_points`` default to all."""
    manifest = package.manifest
    try:
        config = HSTUConfig.from_dict(dict(manifest["model_config"]))
        dtype = DTYPES[str(manifest["key"]["dtype"])]
        retrieve_k = int(manifest["retrieve_k"])
        specs = dict(manifest["constants"])
        precision = ServingPrecision(kv_dtype=str(manifest.get("kv_dtype", "model")))
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise ExportError(f"{package.directory}: manifest is incomplete: {exc}") from exc
    names = tuple(package.files) if entry_points is None else entry_points
    _require_entry_points(package, names)
    device = pinned(device)
    index = -1 if device.type == "cpu" else device.index
    runners: dict[str, Runner] = {}
    derived: dict[str, torch.Tensor] = {}
    for name in names:
        path = package.files[name]
        try:
            with cpu_isa_probe_skipped(device):
                runner = torch._inductor.aoti_load_package(
                    str(path), run_single_threaded=True, device_index=index
                )
            derived |= _bind_weights(runner, path, weights, specs, device)
        except ExportError:
            raise
        except Exception as exc:  # the loader raises RuntimeError, OSError, zip errors ...
            raise ExportError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc
        runners[name] = runner
    return AOTIModel(
        runners, config, dtype, device, retrieve_k, package.directory, weights, check_values,
        lease, kv_storage_dtype(precision, dtype), derived,
    )  # fmt: skip


def open_aoti_model(
    model_dir: Path | str,
    device: str | torch.device,
    cache_dir: Path | str,
    *,
    compile_if_missing: bool,
    checkpoint: Checkpoint | None = None,
    dtype: str | None = None,
    config: ExportConfig | None = None,
    progress: Progress | None = None,
    check_values: bool = True,
    optional: tuple[str, ...] = (),
) -> AOTIModel:
    """The compiled model of ``model_dir`` from the package cache, bound to the weights of
    ``checkpoint`` (that directory loaded on ``device``; loaded here when not given).
    Entry points in ``optional`` are loaded too when the package has them (the worker's
    ``extend_scratch``: generation runs compiled when the package was exported with it).

    Raises ``ExportError`` when no valid package with ``config.entry_points`` exists and
    ``compile_if_missing`` is false (the worker then falls back to eager, or stops under
    ``model.backend = "aoti"``), or when compiling / loading fails. The returned model holds a lease
    on its package, so the cache does not evict it while it serves.
    """
    config = config or ExportConfig()
    target = torch.device(device)
    model_config = read_model_config(model_dir)
    dtype_name = dtype or model_config.dtype
    if dtype_name not in DTYPES:
        raise ExportError(f"dtype={dtype_name!r} must be one of {sorted(DTYPES)}")
    if checkpoint is None:
        checkpoint = _load_checkpoint(model_dir, target, dtype_name)
        apply_precision(checkpoint.model, config.precision)
    elif model_precision(checkpoint.model) != config.precision:
        raise ExportError(
            f"the checkpoint's model is at {model_precision(checkpoint.model)}, the export "
            f"config asks for {config.precision}"
        )
    root = Path(cache_dir)
    configure_inductor(root)
    key = package_key(model_config, dtype_name, checkpoint.version, target, config)
    cache = PackageCache(root)
    lease = cache.lease(key)
    try:
        try:
            package = cache.open(key)
            _require_entry_points(package, config.entry_points)
        except ExportError:
            if not compile_if_missing:
                raise
            package = build_package(
                checkpoint.model, checkpoint.version, root, config, progress=progress
            )
        present = tuple(n for n in optional if n in package.files)
        names = tuple(dict.fromkeys(config.entry_points + present))
        model = load_package(package, target, checkpoint.model, check_values, names, lease)
        if model.retrieve_k != effective_k(model_config, config):
            raise ExportError(
                f"{package.directory}: retrieve_k={model.retrieve_k} disagrees with its key"
            )
    except BaseException:
        lease.release()
        raise
    return model


def _require_entry_points(package: PackageFiles, names: tuple[str, ...]) -> None:
    missing = sorted(set(names) - set(package.files))
    if missing:
        raise ExportError(f"AOTI package {package.directory} lacks entry point(s) {missing}")


def _load_checkpoint(model_dir: Path | str, device: torch.device, dtype: str) -> Checkpoint:
    try:
        return load_checkpoint(model_dir, device=device, dtype=dtype)
    except ModelError as exc:
        raise ExportError(f"cannot load the weights of {model_dir}: {exc}") from exc
