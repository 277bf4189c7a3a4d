"""deploy/: every manifest through a real schema validator, plus the invariants operators rely on.

Core Kubernetes objects are validated with ``kubernetes-validate`` (the Kubernetes OpenAPI
schemas ship inside the wheel; strict mode rejects unknown fields) against the oldest
supported and the newest bundled Kubernetes version. The manifests validated are the
*rendered* base and GPU overlays (tests/deploy/kustomization.py emulates ``kustomize
build`` offline). CRDs (KEDA, Prometheus Operator) are validated with ``jsonschema``
against the small schemas in tests/deploy/schemas/ covering the fields deploy/ uses.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from streamrec.tools.cli import build_parser, config_overrides
from streamrec.tools.probe_command import parse_ports
from streamrec.tools.supervisor import RestartPolicy, child_specs, select_gpus, supervising
from streamrec.worker.config import WorkerConfig
from streamrec.worker.config_sources import load_config
from tests.deploy.kustomization import Kustomization, Resource, load_documents

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = Path(__file__).parent / "schemas"
OVERLAYS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "gpu-eager": K8S / "overlays" / "gpu-eager",
}
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    "ScaledObject": "scaledobject.json",
    "PrometheusRule": "prometheusrule.json",
    "ServiceMonitor": "servicemonitor.json",
}
GPU_OVERLAYS = ("gpu", "gpu-eager")
POD_NAME = "streamrec-0"
# What the GPU overlays run (deploy/README.md, "Several GPUs per node"): the supervisor
# with three worker processes on the pod's one GPU (BENCHMARKS.md, issue 13).
GPU_WORKER_ARGS = [
    "run", "--config", "/etc/streamrec/config.toml", "--gpus", "all", "--workers-per-gpu", "3",
]  # fmt: skip

# The metrics contract (deploy/README.md "Metrics contract"): name -> (type, labels).
CONTRACT_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "streamrec_events_consumed_total": ("counter", frozenset({"topic"})),
    "streamrec_events_invalid_total": ("counter", frozenset({"topic", "kind"})),
    "streamrec_dead_letters_total": ("counter", frozenset()),
    "streamrec_batch_users": ("histogram", frozenset()),
    "streamrec_queue_delay_seconds": ("histogram", frozenset()),
    "streamrec_step_seconds": ("histogram", frozenset({"phase"})),
    "streamrec_cache_hits_total": ("counter", frozenset({"tier"})),
    "streamrec_cache_misses_total": ("counter", frozenset({"tier"})),
    "streamrec_cache_evictions_total": ("counter", frozenset({"tier"})),
    "streamrec_kv_blocks": ("gauge", frozenset({"state"})),
    "streamrec_recommendations_published_total": ("counter", frozenset()),
    "streamrec_event_to_publish_seconds": ("histogram", frozenset()),
    "streamrec_commit_seconds": ("histogram", frozenset()),
    "streamrec_commits_total": ("counter", frozenset()),
    "streamrec_consumer_lag": ("gauge", frozenset({"topic", "partition"})),
    "streamrec_rebalances_total": ("counter", frozenset()),
    "streamrec_model_backend": ("gauge", frozenset({"backend"})),
    "streamrec_last_commit_timestamp_seconds": ("gauge", frozenset()),
}
# Labels Prometheus attaches at scrape time (ServiceMonitor target labels).
TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance", "service", "container"})
# Metrics from outside the worker that the alerts may use.
EXTERNAL_METRICS = frozenset(
    {"up", "kube_statefulset_status_replicas_ready", "kube_statefulset_status_replicas"}
)
REQUIRED_ALERTS = frozenset(
    {
        "StreamrecConsumerLagGrowing",
        "StreamrecDeadLetterRateHigh",
        "StreamrecCacheHitRateLow",
        "StreamrecNoCommitProgress",
        "StreamrecNotReady",
    }
)


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> list[Resource]:
    return Kustomization(OVERLAYS[request.param]).render()


@pytest.fixture(scope="module")
def gpu() -> list[Resource]:
    return Kustomization(OVERLAYS["gpu"]).render()


def only(resources: list[Resource], kind: str, name: str | None = None) -> Resource:
    hits = [r for r in resources if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def worker(resources: list[Resource]) -> dict[str, Any]:
    pod = only(resources, "StatefulSet")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "worker")


def config_toml(resources: list[Resource]) -> str:
    return str(only(resources, "ConfigMap", _config_map_name(resources))["data"]["config.toml"])


def _config_map_name(resources: list[Resource]) -> str:
    pod = only(resources, "StatefulSet")["spec"]["template"]["spec"]
    return next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "config")


def pod_children(resources: list[Resource], directory: Path) -> list[WorkerConfig]:
    """The worker processes of pod 0, each with its config: what `streamrec run` with the
    container's args starts there (the supervisor's children, or the one worker)."""
    container = worker(resources)
    args = build_parser("run").parse_args(container["args"])
    path = directory / "config.toml"
    path.write_text(config_toml(resources))
    config = load_config(path, environ=pod_environ(container), overrides=config_overrides(args))
    if not supervising(args):
        return [config]
    assert args.gpus == "all", "a pod's supervisor runs on the GPUs the pod holds"
    gpus = select_gpus(args.gpus, container["resources"]["limits"]["nvidia.com/gpu"], None)
    specs = child_specs(config, gpus, 0, "no-host-name", workers_per_gpu=args.workers_per_gpu)
    return [spec.config for spec in specs]


def pod_environ(container: dict[str, Any]) -> dict[str, str]:
    """The container's STREAMREC_* environment as the kubelet would set it in pod 0."""
    out = {}
    for env in container.get("env", []):
        if "value" in env:
            out[env["name"]] = env["value"]
        elif env["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            out[env["name"]] = POD_NAME
    return out


# --- schema validation ------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_passes_its_schema(rendered: list[Resource], version: str) -> None:
    for resource in rendered:
        name = f"{resource['kind']}/{resource['metadata']['name']}"
        if resource["kind"] in CRD_SCHEMAS:
            schema = json.loads((SCHEMAS / CRD_SCHEMAS[resource["kind"]]).read_text())
            jsonschema.Draft202012Validator(schema).validate(resource)
            continue
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name} invalid for Kubernetes {version} at {path}: {exc.message}")


def test_validators_reject_a_misspelt_field() -> None:
    # Guards against a validator that silently accepts anything (wrong schema dir, lax mode).
    statefulset = only(Kustomization(OVERLAYS["base"]).render(), "StatefulSet")
    statefulset["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(statefulset, K8S_VERSIONS[0], strict=True)
    scaled = only(Kustomization(OVERLAYS["gpu"]).render(), "ScaledObject")
    scaled["spec"]["maxReplicas"] = 12
    schema = json.loads((SCHEMAS / "scaledobject.json").read_text())
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        jsonschema.Draft202012Validator(schema).validate(scaled)


def test_every_yaml_file_under_deploy_is_rendered_somewhere() -> None:
    files = {p for p in K8S.rglob("*.yaml") if not p.name.startswith("kustomization")}
    used: set[Path] = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        doc = load_documents(kustomization)[0]
        used |= {(kustomization.parent / f).resolve() for f in doc.get("resources", [])}
        used |= {(kustomization.parent / p["path"]).resolve() for p in doc.get("patches", [])}
    assert {p.resolve() for p in files} <= used, "a manifest no kustomization includes"


# --- invariants -------------------------------------------------------------------------


def test_config_map_loads_with_the_worker_config_loader(
    rendered: list[Resource], tmp_path: Path
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(config_toml(rendered))
    config = load_config(path, environ=pod_environ(worker(rendered)))
    assert config.group.group_instance_id == POD_NAME
    assert config.store.url.startswith("redis://"), "more than one replica needs Redis"
    assert config.model.model_dir == Path("/opt/streamrec/model")


def test_grace_period_exceeds_the_drain_bound(rendered: list[Resource]) -> None:
    # A supervisor kills the children still running drain + its kill grace after SIGTERM;
    # the kubelet must not kill the supervisor first (one worker: the same margin).
    drain_s = tomllib.loads(config_toml(rendered))["group"]["drain_timeout_s"]
    pod = only(rendered, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > drain_s + RestartPolicy().kill_grace_s


def test_group_instance_id_is_the_pod_name(rendered: list[Resource], tmp_path: Path) -> None:
    env = {e["name"]: e for e in worker(rendered)["env"]}
    field = env["STREAMREC_GROUP__GROUP_INSTANCE_ID"]["valueFrom"]["fieldRef"]
    assert field["fieldPath"] == "metadata.name"
    pod = only(rendered, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False, "service links inject unknown STREAMREC_* vars"
    # Each process of the pod is its own static member: the pod name, or the pod name
    # and the supervisor's child name (<pod>-gpu0-w<j>), stable across restarts.
    ids = [c.group.group_instance_id or "" for c in pod_children(rendered, tmp_path)]
    assert len(set(ids)) == len(ids)
    assert ids == [POD_NAME] or all(i.startswith(f"{POD_NAME}-gpu0-") for i in ids), ids


EXPECTED_PROBES = {
    "startupProbe": "/healthz",
    "livenessProbe": "/healthz",
    "readinessProbe": "/readyz",
}


def test_probes_cover_every_worker_process(rendered: list[Resource], tmp_path: Path) -> None:
    """The kubelet probes one port; with several processes in the pod an exec probe
    (`streamrec probe`) must reach every child's port, or a hung child goes unnoticed."""
    container = worker(rendered)
    ports = [c.http.port for c in pod_children(rendered, tmp_path)]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert sorted(named.values()) == ports, "one named container port per process"
    assert named["metrics"] == ports[0]
    for probe, path in EXPECTED_PROBES.items():
        if len(ports) == 1:
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}
            continue
        assert "httpGet" not in container[probe], "a probe has one handler"
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["streamrec", "probe"]
        args = build_parser("probe").parse_args(command[1:])
        assert (parse_ports(args.ports), args.path, args.host) == (ports, path, "127.0.0.1")
        assert container[probe]["timeoutSeconds"] > args.timeout, "the kubelet waits it out"


def test_every_worker_process_is_scraped(rendered: list[Resource], tmp_path: Path) -> None:
    container_ports = {p["name"]: p["containerPort"] for p in worker(rendered)["ports"]}
    ports = [c.http.port for c in pod_children(rendered, tmp_path)]
    for service in (r for r in rendered if r["kind"] == "Service"):
        targets = [p["targetPort"] for p in service["spec"]["ports"]]
        assert set(targets) <= container_ports.keys(), service["metadata"]["name"]
    metrics = only(rendered, "Service", "streamrec-metrics")
    by_name = {p["name"]: container_ports[p["targetPort"]] for p in metrics["spec"]["ports"]}
    assert sorted(by_name.values()) == ports
    monitors = [r for r in rendered if r["kind"] == "ServiceMonitor"]
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= metrics["metadata"]["labels"].items()
        endpoints = [e["port"] for e in monitor["spec"]["endpoints"]]
        assert sorted(endpoints) == sorted(by_name), "one scrape endpoint per process"
        assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


def test_every_container_runs_as_non_root(rendered: list[Resource]) -> None:
    pod = only(rendered, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    for container in pod.get("initContainers", []) + pod["containers"]:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    uid = re.search(r"^ARG UID=(\d+)$", dockerfile, re.M)
    assert uid is not None and int(uid.group(1)) == pod["securityContext"]["runAsUser"]


def test_mounts_and_selectors_resolve(rendered: list[Resource]) -> None:
    statefulset = only(rendered, "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    volumes = {v["name"] for v in pod["volumes"]}
    volumes |= {t["metadata"]["name"] for t in statefulset["spec"].get("volumeClaimTemplates", [])}
    for container in pod.get("initContainers", []) + pod["containers"]:
        assert {m["name"] for m in container["volumeMounts"]} <= volumes
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert (
        only(rendered, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
        == (statefulset["spec"]["selector"]["matchLabels"])
    )
    headless = only(rendered, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert pod["serviceAccountName"] == only(rendered, "ServiceAccount")["metadata"]["name"]


def _requests_one_gpu(resources: list[Resource]) -> dict[str, Any]:
    pod = only(resources, "StatefulSet")["spec"]["template"]["spec"]
    for container in pod.get("initContainers", []) + pod["containers"]:
        limits = container["resources"]
        assert limits["requests"]["nvidia.com/gpu"] == limits["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["nodeSelector"]
    return dict(pod)


def test_gpu_overlay_compiles_and_requires_the_package(gpu: list[Resource]) -> None:
    # Production: AOTI packages replayed from CUDA graphs, the fastest worker path measured
    # on the H200 (BENCHMARKS.md, issue 15).
    pod = _requests_one_gpu(gpu)
    statefulset = only(gpu, "StatefulSet")
    assert "aoti-cache" not in {v["name"] for v in pod["volumes"]}
    assert [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]] == [
        "aoti-cache"
    ]
    environ = pod_environ(worker(gpu))
    assert environ["STREAMREC_MODEL__DEVICE"] == "cuda"
    assert environ["STREAMREC_MODEL__BACKEND"] == "aoti"
    assert environ["STREAMREC_MODEL__CUDA_GRAPHS"] == "true"  # AOTI in graphs
    assert pod["initContainers"][0]["args"][0] == "export"


def test_gpu_eager_overlay_serves_eager_from_cuda_graphs() -> None:
    # No package to compile, so no init container and no package volume.
    rendered = Kustomization(OVERLAYS["gpu-eager"]).render()
    pod = _requests_one_gpu(rendered)
    assert "initContainers" not in pod
    assert "volumeClaimTemplates" not in only(rendered, "StatefulSet")["spec"]
    environ = pod_environ(worker(rendered))
    assert environ["STREAMREC_MODEL__DEVICE"] == "cuda"
    assert environ["STREAMREC_MODEL__BACKEND"] == "eager"
    assert environ["STREAMREC_MODEL__CUDA_GRAPHS"] == "true"


def test_autoscaling_never_exceeds_the_partition_count(gpu: list[Resource], tmp_path: Path) -> None:
    # Every worker process is a group member: a pod is as many members as it has
    # processes, and a member beyond the partition count sits idle with its GPU share.
    scaled = only(gpu, "ScaledObject")
    partitions = int(scaled["metadata"]["annotations"]["streamrec.dev/input-partitions"])
    spec = scaled["spec"]
    members_per_pod = len(pod_children(gpu, tmp_path))
    assert members_per_pod == 3
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["maxReplicaCount"] * members_per_pod <= partitions
    statefulset = only(gpu, "StatefulSet")
    assert "replicas" not in statefulset["spec"], "KEDA owns the replica count"
    base = Kustomization(OVERLAYS["base"]).render()
    base_replicas = only(base, "StatefulSet")["spec"]["replicas"]
    assert base_replicas * len(pod_children(base, tmp_path)) <= partitions
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", statefulset["metadata"]["name"])
    config = tomllib.loads(config_toml(gpu))
    topics = {config["topics"]["playback"], config["topics"]["interaction"]}
    assert {t["metadata"]["topic"] for t in spec["triggers"]} == topics
    for trigger in spec["triggers"]:
        assert trigger["type"] == "kafka"
        assert trigger["metadata"]["consumerGroup"] == config["group"]["group_id"]
        assert trigger["metadata"]["bootstrapServers"] == config["kafka"]["bootstrap_servers"]
        assert trigger["metadata"]["allowIdleConsumers"] == "false"


# --- alerts, dashboard and the metrics contract -----------------------------------------

_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_BUCKET_LABEL = frozenset({"le"})


def promql_metrics(expr: str) -> set[str]:
    """Names that can only be metrics: ours (streamrec_*), kube_*, up, recording rules."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    names = set(_IDENTIFIER.findall(without_strings))
    return {n for n in names if n.startswith(("streamrec", "kube_")) or n == "up"}


def contract_name(metric: str) -> str | None:
    """The contract metric a series name belongs to (histograms: _bucket/_sum/_count)."""
    if metric in CONTRACT_METRICS:
        return metric
    base, _, suffix = metric.rpartition("_")
    if suffix in ("bucket", "sum", "count") and CONTRACT_METRICS.get(base, ("",))[0] == "histogram":
        return base
    return None


def check_expression(expr: str, recorded: set[str]) -> None:
    assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), expr
    for metric in promql_metrics(expr):
        if metric in recorded or metric in EXTERNAL_METRICS:
            continue
        assert contract_name(metric) is not None, f"{metric!r} is not in the metrics contract"
    for metric, selector in _SELECTOR.findall(re.sub(r'"[^"]*"', '""', expr)):
        name = contract_name(metric)
        if name is None:
            continue
        labels = {m.split("=")[0].strip(" !~") for m in selector.split(",") if m.strip()}
        allowed = CONTRACT_METRICS[name][1] | TARGET_LABELS
        if metric.endswith("_bucket"):
            allowed = allowed | _BUCKET_LABEL
        assert labels <= allowed, f"{metric} selects unknown labels {labels - allowed}"


def test_alert_rules_cover_the_required_conditions(gpu: list[Resource]) -> None:
    rules = [rule for g in only(gpu, "PrometheusRule")["spec"]["groups"] for rule in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert alerts.keys() >= REQUIRED_ALERTS
    readme = (DEPLOY / "README.md").read_text()
    for rule in rules:
        check_expression(rule["expr"], recorded)
    for name, rule in alerts.items():
        assert rule["annotations"]["runbook"] == f"deploy/README.md#{name.lower()}"
        assert f"\n### {name}\n" in readme, f"README has no runbook section for {name}"


def test_dashboard_shows_every_contract_metric(gpu: list[Resource]) -> None:
    dashboard = json.loads(
        only(gpu, "ConfigMap", "streamrec-dashboard")["data"]["streamrec-dashboard.json"]
    )
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            check_expression(target["expr"], set())
            used |= {n for m in promql_metrics(target["expr"]) if (n := contract_name(m))}
    assert used == CONTRACT_METRICS.keys(), f"no panel for {set(CONTRACT_METRICS) - used}"
    assert only(gpu, "ConfigMap", "streamrec-dashboard")["metadata"]["labels"] == {
        "grafana_dashboard": "1"
    }


def test_readme_documents_the_metrics_contract() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for metric, (kind, labels) in CONTRACT_METRICS.items():
        row = next((line for line in readme.splitlines() if f"`{metric}`" in line), None)
        assert row is not None, f"README lacks {metric}"
        assert kind in row and all(f"`{label}`" in row for label in labels), row


def test_dockerfile_pins_the_tested_torch_and_checks_health() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert pinned is not None
    assert f"ARG TORCH_VERSION={pinned.group(1)}\n" in dockerfile
    assert re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", dockerfile, re.M)
    assert "/healthz" in dockerfile and "EXPOSE 9400" in dockerfile
    stages = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M)
    assert stages[-1] == "runtime", "the default (last) target must not need a GPU builder"
    assert "USER ${UID}:${UID}" in dockerfile
    assert yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]


def test_jit_caches_live_on_the_writable_cache_volume(rendered: list[Resource]) -> None:
    """The root filesystem is read-only and the uid has no home: Triton's and Inductor's
    compile caches must point into the mounted cache volume, or the eager GPU worker
    cannot compile its first kernel."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pod = only(rendered, "StatefulSet")["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    writable = [m["mountPath"] for m in worker["volumeMounts"] if not m.get("readOnly")]
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_HOME", "TRITON_CACHE_DIR"):
        found = re.search(rf"\b{var}=(\S+)", dockerfile)
        assert found is not None, var
        assert any(found.group(1).startswith(path) for path in writable), (var, writable)


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_pods_run_three_worker_processes_on_their_one_gpu(overlay: str, tmp_path: Path) -> None:
    # One pod per GPU, three processes on it (deploy/README.md, "Several GPUs per node"):
    # one process's host path cannot keep the GPU busy (BENCHMARKS.md, issue 13). The
    # probes and the scrape reach every child (the two tests above).
    rendered = Kustomization(OVERLAYS[overlay]).render()
    container = worker(rendered)
    assert container["args"] == GPU_WORKER_ARGS
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    children = pod_children(rendered, tmp_path)
    assert [c.group.group_instance_id for c in children] == [
        f"{POD_NAME}-gpu0-w{j}" for j in range(3)
    ]
    assert [c.http.port for c in children] == [9400, 9401, 9402]
    one = load_config(tmp_path / "config.toml", environ=pod_environ(container))  # no split
    for child in children:  # the GPU's budgets split three ways, not tripled
        assert child.cache.kv_budget_fraction == pytest.approx(one.cache.kv_budget_fraction / 3)
        assert child.cache.host_tier_bytes == one.cache.host_tier_bytes // 3


def test_cpu_pods_run_one_worker_process_each(tmp_path: Path) -> None:
    # The base (CPU pods, staging) stays one process per pod: nothing there is GPU-bound
    # behind one process's host path.
    base = Kustomization(OVERLAYS["base"]).render()
    assert worker(base)["args"] == ["run", "--config", "/etc/streamrec/config.toml"]
    assert len(pod_children(base, tmp_path)) == 1
