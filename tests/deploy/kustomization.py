"""An offline stand-in for `kustomize build`, covering exactly the subset deploy/k8s uses.

kustomize is a Go binary that is not on PyPI, and CI reaches nothing but package
registries, so the tests render the overlays themselves. The emulation is deliberately
narrow: a kustomization using any field outside ``SUPPORTED_FIELDS`` raises instead of
being half-rendered, so a manifest change that needs the real tool fails loudly here.

Supported: ``resources`` (files and directories), ``components``, ``configMapGenerator``
(``files``, ``options.labels``, ``options.disableNameSuffixHash``), ``patches`` (``path``
to a strategic-merge patch naming its target by kind and name) and ``images``
(``name`` -> ``newName``:``newTag``). Strategic merge follows the Kubernetes patch
strategy of the fields we patch: lists in ``MERGE_KEYS`` (``SERVICE_MERGE_KEYS`` in a
Service) merge item by item, an item with ``$patch: delete`` removes its match, ``null``
removes a field, other lists are replaced (as kustomize does for CRDs, which carry no
merge keys). Generated ConfigMap names get a content-hash suffix (not byte-identical to
kustomize's) and pod-template references to them are rewritten, as kustomize does.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED_FIELDS = frozenset(
    {"apiVersion", "kind", "resources", "components", "configMapGenerator", "patches", "images"}
)
# Patch merge keys of the Kubernetes types touched by the patches (x-kubernetes-patch-merge-key).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
# A Service's spec.ports merge by port number (ServiceSpec.ports' patch merge key).
SERVICE_MERGE_KEYS = {**MERGE_KEYS, "ports": "port"}
MERGE_KEYS_BY_KIND = {"Service": SERVICE_MERGE_KEYS}
_FILE_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


class KustomizeError(ValueError):
    """A kustomization this emulator cannot render faithfully."""


def load_documents(path: Path) -> list[Resource]:
    """Every non-empty YAML document of a file (multi-document files allowed)."""
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def strategic_merge(
    base: Any, patch: Any, field: str = "", merge_keys: dict[str, str] = MERGE_KEYS
) -> Any:
    """Merge ``patch`` into a copy of ``base`` the way the API server's SMP does
    (``merge_keys``: the list fields that merge item by item, and their keys)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key, merge_keys)
            else:
                out[key] = _strip_directives(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in merge_keys:
        return _merge_list(base, patch, merge_keys[field], merge_keys)
    return _strip_directives(patch)


def _merge_list(
    base: list[Any], patch: list[Any], key: str, merge_keys: dict[str, str]
) -> list[Any]:
    out = copy.deepcopy(base)
    for item in patch:
        if key not in item:
            raise KustomizeError(f"patch list item {item!r} lacks its merge key {key!r}")
        index = next((i for i, b in enumerate(out) if b.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is None:
                raise KustomizeError(f"$patch: delete of {key}={item[key]!r} matches nothing")
            del out[index]
        elif index is None:
            out.append(_strip_directives(item))
        else:
            out[index] = strategic_merge(out[index], item, merge_keys=merge_keys)
    return out


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _pod_specs(resource: Resource) -> list[dict[str, Any]]:
    spec = resource.get("spec", {})
    if resource.get("kind") == "Pod":
        return [spec]
    template = spec.get("template", {}).get("spec")
    return [template] if template is not None else []


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]


class Kustomization:
    """One kustomization directory; ``render()`` is ``kustomize build <root>``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        path = next((root / n for n in _FILE_NAMES if (root / n).is_file()), None)
        if path is None:
            raise KustomizeError(f"no kustomization file in {str(root)!r}")
        self.path = path
        doc = load_documents(path)[0]
        unknown = set(doc) - SUPPORTED_FIELDS
        if unknown:
            raise KustomizeError(f"{str(path)!r} uses fields the emulator lacks: {sorted(unknown)}")
        self.doc: dict[str, Any] = doc

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind", "Kustomization"))

    def render(self) -> list[Resource]:
        resources, renames = self._build([])
        for resource in resources:
            for pod_spec in _pod_specs(resource):
                _rename_config_maps(pod_spec, renames)
        return resources

    def _build(self, resources: list[Resource]) -> tuple[list[Resource], dict[str, str]]:
        """Resources, components, generators, patches, images: kustomize's order."""
        renames: dict[str, str] = {}
        out = [copy.deepcopy(r) for r in resources]
        for entry in self.doc.get("resources", []):
            target = self.root / entry
            if target.is_dir():
                child, child_renames = Kustomization(target)._build([])
                out.extend(child)
                renames.update(child_renames)
            else:
                out.extend(load_documents(target))
        for entry in self.doc.get("components", []):
            component = Kustomization(self.root / entry)
            if component.kind != "Component":
                raise KustomizeError(f"{entry!r} is listed as a component but is {component.kind}")
            out, component_renames = component._build(out)
            renames.update(component_renames)
        for generator in self.doc.get("configMapGenerator", []):
            config_map = self._generate_config_map(generator)
            renames[generator["name"]] = config_map["metadata"]["name"]
            out.append(config_map)
        for patch in self.doc.get("patches", []):
            out = self._apply_patch(out, patch)
        for image in self.doc.get("images", []):
            _set_image(out, image)
        return out, renames

    def _generate_config_map(self, generator: dict[str, Any]) -> Resource:
        unknown = set(generator) - {"name", "files", "options"}
        if unknown:
            raise KustomizeError(f"configMapGenerator fields not emulated: {sorted(unknown)}")
        data = {Path(f).name: (self.root / f).read_text() for f in generator.get("files", [])}
        options = generator.get("options", {})
        name = generator["name"]
        if not options.get("disableNameSuffixHash", False):
            digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
            name = f"{name}-{digest[:10]}"
        metadata: dict[str, Any] = {"name": name}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}

    def _apply_patch(self, resources: list[Resource], patch: dict[str, Any]) -> list[Resource]:
        if set(patch) != {"path"}:
            raise KustomizeError(f"only file patches are emulated, got {patch!r}")
        body = load_documents(self.root / patch["path"])[0]
        target = (body["kind"], body["metadata"]["name"])
        hits = [i for i, r in enumerate(resources) if (r["kind"], r["metadata"]["name"]) == target]
        if len(hits) != 1:
            raise KustomizeError(f"patch {patch['path']!r} matches {len(hits)} resources")
        out = list(resources)
        merge_keys = MERGE_KEYS_BY_KIND.get(body["kind"], MERGE_KEYS)
        out[hits[0]] = strategic_merge(resources[hits[0]], body, merge_keys=merge_keys)
        return out


def _set_image(resources: list[Resource], image: dict[str, Any]) -> None:
    for resource in resources:
        for pod_spec in _pod_specs(resource):
            for container in _containers(pod_spec):
                name = container["image"].split("@")[0].rsplit(":", 1)[0]
                if name == image["name"]:
                    new_name = image.get("newName", image["name"])
                    tag = image.get("newTag")
                    container["image"] = f"{new_name}:{tag}" if tag else new_name


def _rename_config_maps(pod_spec: dict[str, Any], renames: dict[str, str]) -> None:
    for volume in pod_spec.get("volumes", []):
        if "configMap" in volume:
            ref = volume["configMap"]
            ref["name"] = renames.get(ref["name"], ref["name"])
    for container in _containers(pod_spec):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref is not None:
                ref["name"] = renames.get(ref["name"], ref["name"])
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef")
            if ref is not None:
                ref["name"] = renames.get(ref["name"], ref["name"])
