"""The offline kustomize emulator: the merge rules the deploy/ patches depend on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kustomization import Kustomization, KustomizeError, strategic_merge

POD: dict[str, Any] = {
    "containers": [
        {
            "name": "worker",
            "image": "app",
            "env": [{"name": "A", "value": "1"}],
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        }
    ],
    "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
}


def test_named_lists_merge_item_by_item() -> None:
    patch = {"containers": [{"name": "worker", "env": [{"name": "B", "value": "2"}]}]}
    merged = strategic_merge(POD, patch)
    assert merged["containers"][0]["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "2"},
    ]
    assert merged["containers"][0]["image"] == "app"
    assert POD["containers"][0]["env"] == [{"name": "A", "value": "1"}], "base not mutated"


def test_delete_directive_and_null_remove() -> None:
    merged = strategic_merge(
        {"replicas": 2, **POD},
        {"replicas": None, "volumes": [{"name": "cache", "$patch": "delete"}]},
    )
    assert "replicas" not in merged
    assert merged["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    with pytest.raises(KustomizeError, match="matches nothing"):
        strategic_merge(POD, {"volumes": [{"name": "absent", "$patch": "delete"}]})


def test_unkeyed_lists_are_replaced() -> None:
    merged = strategic_merge({"args": ["a", "b"]}, {"args": ["c"]})
    assert merged == {"args": ["c"]}


def test_ports_merge_by_container_port_in_pods_and_by_port_in_services(tmp_path: Path) -> None:
    port = {"name": "metrics", "port": 9400, "targetPort": "metrics"}
    (tmp_path / "objects.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: svc}\n"
        f"spec: {{ports: [{json.dumps(port)}]}}\n---\n"
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n"
        "spec:\n  template:\n    spec:\n      containers:\n"
        "        - {name: c, image: app, ports: [{name: metrics, containerPort: 9400}]}\n"
    )
    (tmp_path / "service.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: svc}\n"
        "spec: {ports: [{name: metrics-w1, port: 9401, targetPort: metrics-w1}]}\n"
    )
    (tmp_path / "deployment.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n"
        "spec:\n  template:\n    spec:\n      containers:\n"
        "        - {name: c, ports: [{name: metrics-w1, containerPort: 9401}]}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [objects.yaml]\npatches: [{path: service.yaml}, {path: deployment.yaml}]\n"
    )
    service, deployment = Kustomization(tmp_path).render()
    assert [p["port"] for p in service["spec"]["ports"]] == [9400, 9401]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in container["ports"]] == [9400, 9401]


def test_unsupported_kustomization_field_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="commonLabels"):
        Kustomization(tmp_path)


def test_generated_config_map_is_hashed_and_referenced(tmp_path: Path) -> None:
    (tmp_path / "app.toml").write_text("x = 1\n")
    (tmp_path / "deploy.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n"
        "spec:\n  template:\n    spec:\n      containers: [{name: c, image: app}]\n"
        "      volumes: [{name: cfg, configMap: {name: app-config}}]\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [deploy.yaml]\n"
        "configMapGenerator: [{name: app-config, files: [app.toml]}]\n"
        "images: [{name: app, newName: registry/app, newTag: '1.2'}]\n"
    )
    deployment, config_map = Kustomization(tmp_path).render()
    name = config_map["metadata"]["name"]
    assert name.startswith("app-config-") and config_map["data"] == {"app.toml": "x = 1\n"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["volumes"][0]["configMap"]["name"] == name
    assert pod["containers"][0]["image"] == "registry/app:1.2"
