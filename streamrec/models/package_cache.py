"""On-disk cache of compiled AOTInductor packages, one directory per ``PackageKey``.

A package is only valid for the exact weights, model code, torch build, device kind,
dtype and export settings it was compiled from, so all of them go into the key and a
mismatch finds a different (missing) directory instead of a stale one. (The weights are
not inside the package, but Inductor folds constants whose values it can see, e.g. an
all-ones LayerNorm weight, so a package is still tied to the weights it was built from.)

A directory holds one ``.pt2`` per compiled entry point; entry points are added by
publishing a new directory that carries the old files over. Directories are built under
a temporary name and published with one ``rename``, so a concurrent reader sees either
the old or the new complete package; an exclusive ``flock`` per key keeps two processes
from compiling the same package twice.

The cache is bounded (``max_bytes``): publishing evicts the least recently used packages
until the rest fit, never one that a process holds a ``PackageLease`` on (a shared
``flock`` that the serving process keeps while it serves), nor the one just published.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from streamrec.errors import ExportError

MANIFEST = "manifest.json"
# Bump when the layout of a package directory or of its manifest changes.
# 2: weights outside the .pt2 (bound at load), entry points accumulate per directory.
LAYOUT_VERSION = 2
DEFAULT_MAX_BYTES = 4 << 30  # packages hold no weights: tens of MB each on the H200
STALE_STAGING_S = 3600.0  # a .tmp-/.trash- directory this old belongs to a dead process
_HASH_CHUNK = 1 << 22


def device_kind(device: torch.device) -> str:
    """ "cpu" or "cuda-sm90": compiled kernels only run on the architecture they target."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda-sm{major}{minor}"
    return device.type


@dataclass(frozen=True)
class PackageKey:
    """Everything a compiled package depends on; ``dirname`` is unique per key."""

    model_version: str
    torch_version: str
    device_kind: str
    dtype: str
    export_hash: str  # hash of the export settings and of the model's source code

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value or "/" in value or value.startswith("."):
                raise ExportError(f"PackageKey.{name}={value!r} must be a non-empty plain name")

    @property
    def dirname(self) -> str:
        torch_tag = self.torch_version.replace("+", "_")
        return (
            f"{self.model_version}-{self.device_kind}-{self.dtype}-t{torch_tag}-{self.export_hash}"
        )

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class PackageFiles:
    """A verified package directory: one ``.pt2`` per entry point plus its manifest."""

    directory: Path
    files: dict[str, Path]  # entry point name -> .pt2
    manifest: dict[str, Any]


class PackageLease:
    """A shared lock on one package directory: ``evict`` skips it while it is held.

    The serving process keeps its lease for as long as it serves the package (the lock
    dies with the process, so a crash leaves nothing behind). A raw descriptor, not a
    file object: the model holding it may be freed by the cycle collector, where a file
    object would warn about being closed by its finalizer.
    """

    def __init__(self, fd: int | None, directory: Path) -> None:
        self._fd = fd  # None: a read-only cache, where nothing evicts either
        self.directory = directory

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock

    def __del__(self) -> None:  # the model that held it is gone: so is its use
        self.release()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


class PackageCache:
    """Root directory holding one sub-directory per ``PackageKey``."""

    def __init__(self, root: Path | str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ExportError(f"PackageCache max_bytes={max_bytes} must be > 0")
        self.root = Path(root)
        self.max_bytes = max_bytes

    def directory(self, key: PackageKey) -> Path:
        return self.root / key.dirname

    @contextlib.contextmanager
    def lock(self, key: PackageKey) -> Iterator[None]:
        """Exclusive per-key lock held while compiling (other compilers wait, readers don't)."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = self.root / f".{key.dirname}.lock"
        with lock_path.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def lease(self, key: PackageKey) -> PackageLease:
        """Mark ``key``'s package as in use (and as used now, for the LRU order).

        On a read-only cache (a package baked into the image) there is nothing to mark
        and nobody to evict: the lease is empty.
        """
        path = self._use_file(self.directory(key))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            return PackageLease(None, self.directory(key))
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(OSError):
            os.utime(path)
        return PackageLease(fd, self.directory(key))

    def staging(self, key: PackageKey) -> Path:
        """A fresh private directory to build ``key``'s package in (same filesystem)."""
        tmp = self.root / f".tmp-{key.dirname}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    def carry_over(self, package: PackageFiles, staging: Path) -> dict[str, str]:
        """Hard-link (or copy) ``package``'s files into ``staging``: name -> file name."""
        carried: dict[str, str] = {}
        for name, path in package.files.items():
            target = staging / path.name
            try:
                os.link(path, target)
            except OSError:  # another filesystem, or links not supported
                shutil.copy2(path, target)
            carried[name] = path.name
        return carried

    def publish(
        self, key: PackageKey, staging: Path, files: dict[str, str], extra: dict[str, Any]
    ) -> PackageFiles:
        """Write the manifest into ``staging``, rename it to the key's directory, evict.

        ``files`` maps entry point -> file name inside ``staging``. A package already at
        the destination (an older set of entry points, a corrupt one, or one built by a
        process that did not hold the lock) is moved aside first; the rename itself is
        atomic.
        """
        manifest: dict[str, Any] = {
            "layout_version": LAYOUT_VERSION,
            "key": key.to_dict(),
            "files": {
                name: {
                    "file": file,
                    "bytes": (staging / file).stat().st_size,
                    "sha256": sha256_file(staging / file),
                }
                for name, file in files.items()
            },
            **extra,
        }
        tmp_manifest = staging / f"{MANIFEST}.tmp"
        tmp_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp_manifest.replace(staging / MANIFEST)
        final = self.directory(key)
        if final.exists():
            self.discard(final)
        staging.rename(final)
        self.evict(keep=(final,))
        return self.open(key)

    def discard(self, directory: Path) -> None:
        """Rename first (readers stop seeing it at once), then delete."""
        trash = self.root / f".trash-{directory.name}-{uuid.uuid4().hex[:8]}"
        directory.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)

    def open(self, key: PackageKey, verify_hashes: bool = True) -> PackageFiles:
        """The key's package, checked against its manifest; ``ExportError`` says why not."""
        directory = self.directory(key)
        if not directory.is_dir():
            raise ExportError(f"no AOTI package for {key.dirname} under {self.root}")
        manifest_path = directory / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise ExportError(f"{manifest_path}: unreadable manifest: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("key") != key.to_dict():
            found = manifest.get("key") if isinstance(manifest, dict) else manifest
            raise ExportError(f"{manifest_path}: key {found!r} does not match {key.to_dict()!r}")
        if manifest.get("layout_version") != LAYOUT_VERSION:
            raise ExportError(
                f"{manifest_path}: layout_version={manifest.get('layout_version')!r}, "
                f"this streamrec reads {LAYOUT_VERSION}"
            )
        files: dict[str, Path] = {}
        for name, entry in dict(manifest.get("files", {})).items():
            path = directory / str(entry["file"])
            size = path.stat().st_size if path.is_file() else None
            if size != entry["bytes"]:
                raise ExportError(
                    f"{path}: {size} bytes on disk, manifest says {entry['bytes']} (corrupt)"
                )
            if verify_hashes and sha256_file(path) != entry["sha256"]:
                raise ExportError(f"{path}: sha256 differs from the manifest (corrupt)")
            files[name] = path
        return PackageFiles(directory=directory, files=files, manifest=manifest)

    # ------------------------------------------------------------------ eviction

    def packages(self) -> list[Path]:
        """Published package directories, least recently used first."""
        if not self.root.is_dir():
            return []
        found = [
            d for d in self.root.iterdir()
            if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file()
        ]  # fmt: skip
        return sorted(found, key=self._last_used)

    def evict(self, keep: Collection[Path] = ()) -> list[Path]:
        """Delete least recently used packages until the cache fits ``max_bytes``.

        Never a directory in ``keep`` nor one under a lease (in use by some process).
        Also clears staging and trash directories left by dead processes. Returns the
        deleted package directories.
        """
        self._sweep_stale()
        packages = self.packages()
        sizes = {d: _tree_bytes(d) for d in packages}
        total = sum(sizes.values())
        kept = {Path(k).resolve() for k in keep}
        removed: list[Path] = []
        for directory in packages:
            if total <= self.max_bytes:
                break
            if directory.resolve() in kept:
                continue
            with self._unused(directory) as free:
                if not free:
                    continue
                self.discard(directory)
            removed.append(directory)
            total -= sizes[directory]
        return removed

    def _use_file(self, directory: Path) -> Path:
        return self.root / f".{directory.name}.use"

    def _last_used(self, directory: Path) -> float:
        for path in (self._use_file(directory), directory / MANIFEST):
            with contextlib.suppress(OSError):
                return path.stat().st_mtime
        return 0.0

    @contextlib.contextmanager
    def _unused(self, directory: Path) -> Iterator[bool]:
        """True (holding the directory's use lock exclusively) when nobody leases it."""
        path = self._use_file(directory)
        with path.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _sweep_stale(self) -> None:
        if not self.root.is_dir():
            return
        now = time.time()
        for path in self.root.iterdir():
            if not path.name.startswith((".tmp-", ".trash-")) or not path.is_dir():
                continue
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > STALE_STAGING_S:
                    shutil.rmtree(path, ignore_errors=True)
