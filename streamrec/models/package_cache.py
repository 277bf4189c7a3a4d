"""On-disk cache of compiled AOTInductor packages, one directory per ``PackageKey``.

A package is only valid for the exact weights, model code, torch build, device kind,
dtype and export settings it was compiled from, so all of them go into the key and a
mismatch finds a different (missing) directory instead of a stale one. Directories are
built under a temporary name and published with one ``rename``, so a concurrent reader
sees either nothing or a complete package; an exclusive ``flock`` per key keeps two
processes from compiling the same package twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from streamrec.errors import ExportError

MANIFEST = "manifest.json"
# Bump when the layout of a package directory or of its manifest changes.
LAYOUT_VERSION = 1
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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class PackageCache:
    """Root directory holding one sub-directory per ``PackageKey``."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

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

    def staging(self, key: PackageKey) -> Path:
        """A fresh private directory to build ``key``'s package in (same filesystem)."""
        tmp = self.root / f".tmp-{key.dirname}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    def publish(
        self, key: PackageKey, staging: Path, files: dict[str, str], extra: dict[str, Any]
    ) -> PackageFiles:
        """Write the manifest into ``staging`` and rename it to the key's directory.

        ``files`` maps entry point -> file name inside ``staging``. A package already at
        the destination (corrupt, or built by a process that did not hold the lock) is
        moved aside first; the rename itself is atomic.
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
