"""The Kubernetes manifests: every overlay builds, validates offline against the Kubernetes schemas,
and says what docs/design.md §7 promises (probes, GPUs, headless drafters, autoscaler, policies)."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from deploy_tools import K8S, OVERLAYS, by_kind, kustomize

from specsplit.cli import parse_args
from specsplit.verifier.drafter_pool import parse_targets

TREES = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
# 1.27: the oldest release with native gRPC probes (GA); and the newest.
K8S_VERSIONS = ["1.27", kubernetes_validate.latest_version()]
ROLES = {"coordinator": 50051, "verifier": 50052, "drafter": 50053}


def render(tree: str) -> tuple[dict, ...]:
    return kustomize(str(K8S / tree))


def workloads(docs) -> dict[str, dict]:
    """role -> its Deployment's single container, with the pod spec under '_pod'."""
    out = {}
    for name, dep in by_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        out[name.removeprefix("specsplit-")] = {**container, "_pod": pod}
    return out


def test_there_is_a_cpu_demo_and_a_gpu_overlay():
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("tree", TREES)
def test_every_tree_builds_the_whole_deployment(tree):
    docs = render(tree)
    assert set(by_kind(docs, "Deployment")) == {f"specsplit-{r}" for r in [*ROLES, "otel-collector"]}
    assert set(by_kind(docs, "Service")) == {f"specsplit-{r}" for r in [*ROLES, "otel-collector"]}
    assert set(by_kind(docs, "PodDisruptionBudget")) == {f"specsplit-{r}" for r in ROLES}
    assert set(by_kind(docs, "HorizontalPodAutoscaler")) == {"specsplit-drafter"}
    assert len(by_kind(docs, "NetworkPolicy")) >= 4
    assert any(name.startswith("specsplit-config-") for name in by_kind(docs, "ConfigMap"))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("tree", TREES)
def test_every_manifest_validates_against_the_kubernetes_schemas(tree, version):
    for doc in render(tree):
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_rejects_an_unknown_field():
    broken = yaml.safe_load(yaml.safe_dump(by_kind(render("base"), "Deployment")["specsplit-drafter"]))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")  # a typo kubectl apply would reject
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("tree", TREES)
def test_services_have_grpc_probes_limits_non_root_and_graceful_shutdown(tree):
    for role, port in ROLES.items():
        c = workloads(render(tree))[role]
        assert {p["containerPort"] for p in c["ports"]} == {port, 9464}
        assert f"--port={port}" in c["args"] and "--metrics-port=9464" in c["args"]
        service = f"specsplit.v1.{role.capitalize()}"
        for probe in ("startupProbe", "readinessProbe"):  # ready only once the weights are loaded
            assert c[probe]["grpc"] == {"port": port, "service": service}
        assert c["livenessProbe"]["grpc"]["port"] == port
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
        pod = c["_pod"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
        # the server's drain after SIGTERM (delay, then grace for calls in flight) fits in the pod's
        flags = dict(a.removeprefix("--").split("=", 1) for a in c["args"])
        drain = float(flags["shutdown-delay"]) + float(flags["shutdown-grace"])
        assert float(flags["shutdown-delay"]) > 0 and pod["terminationGracePeriodSeconds"] >= drain + 5


@pytest.mark.parametrize("tree", TREES)
def test_container_args_are_ones_the_specsplit_cli_accepts(tree):
    docs = render(tree)
    (config,) = [d["data"] for n, d in by_kind(docs, "ConfigMap").items() if n.startswith("specsplit-config-")]
    for role in ROLES:
        c = workloads(docs)[role]
        assert {e["configMapRef"]["name"] for e in c["envFrom"]} == {
            n for n in by_kind(docs, "ConfigMap") if n.startswith("specsplit-config-")
        }
        args = [re.sub(r"\$\((\w+)\)", lambda m: config[m.group(1)], a) for a in c["args"]]
        parsed = parse_args(["serve", role, *args])  # exits (fails the test) on a bad flag
        assert parsed.host == "0.0.0.0" and parsed.port == ROLES[role]


def test_gpu_overlay_gives_verifier_and_each_drafter_a_gpu_and_the_cpu_demo_none():
    gpu, cpu = workloads(render("overlays/gpu")), workloads(render("overlays/cpu-demo"))
    for role in ("verifier", "drafter"):
        assert gpu[role]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert gpu[role]["image"].endswith("-cuda") and cpu[role]["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in str(cpu[role]["resources"])
    assert "nvidia.com/gpu" not in str(gpu["coordinator"]["resources"])
    config = {n: d for n, d in by_kind(render("overlays/gpu"), "ConfigMap").items() if "config" in n}
    (data,) = [d["data"] for d in config.values()]
    assert data["SPECSPLIT_DEVICE"].startswith("cuda") and data["SPECSPLIT_MODEL"].startswith("/models/")


@pytest.mark.parametrize("tree", TREES)
def test_the_verifier_finds_drafter_replicas_through_a_headless_service(tree):
    docs = render(tree)
    drafter_svc = by_kind(docs, "Service")["specsplit-drafter"]
    assert drafter_svc["spec"]["clusterIP"] == "None"
    (config,) = [d["data"] for n, d in by_kind(docs, "ConfigMap").items() if n.startswith("specsplit-config-")]
    assert "--drafter=$(SPECSPLIT_DRAFTERS)" in workloads(docs)["verifier"]["args"]
    (target,) = parse_targets(config["SPECSPLIT_DRAFTERS"])
    assert target == f"dns:///specsplit-drafter:{drafter_svc['spec']['ports'][0]['port']}"
    assert drafter_svc["spec"]["ports"][0]["port"] == ROLES["drafter"]


@pytest.mark.parametrize("tree", TREES)
def test_drafter_autoscaler_watches_metrics_the_prometheus_adapter_serves(tree):
    hpa = by_kind(render(tree), "HorizontalPodAutoscaler")["specsplit-drafter"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specsplit-drafter"}
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    watched = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    served = {r["name"]["as"] for r in adapter["rules"]["custom"]}
    assert watched == served == {"specsplit_drafter_queue_depth", "specsplit_drafter_propose_latency_p95_seconds"}
    sources = {re.match(r"\w+", r["seriesQuery"]).group(0) for r in adapter["rules"]["custom"]}
    assert sources == {"specsplit_drafter_queue_depth", "specsplit_drafter_propose_latency_seconds_bucket"}


def _allowed(policies: list[dict], src: dict | None, dst: dict, port: int, src_ns: dict | None = None) -> bool:
    """NetworkPolicy ingress semantics. src: the caller's pod labels (None: not a pod of ours);
    src_ns: the labels of the caller's namespace when it is not ours."""

    def selects(selector: dict, labels: dict | None) -> bool:
        return labels is not None and selector.get("matchLabels", {}).items() <= labels.items()

    def peer_matches(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            return selects(peer["namespaceSelector"], src_ns) and selects(peer.get("podSelector", {}), src or {})
        return src_ns is None and selects(peer["podSelector"], src)

    selecting = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            if not rule.get("from") or any(peer_matches(peer) for peer in rule["from"]):
                return True
    return False


def test_network_policies_let_only_the_coordinator_reach_the_verifier_and_only_it_and_the_verifier_drafters():
    policies = list(by_kind(render("base"), "NetworkPolicy").values())
    pods = {
        r: {"app.kubernetes.io/name": "specsplit", "app.kubernetes.io/component": r} for r in [*ROLES, "otel-collector"]
    }
    allowed = {
        (src, dst)
        for src in [*pods, None]
        for dst, port in ROLES.items()
        if _allowed(policies, pods.get(src), pods[dst], port)
    }
    assert allowed == {
        *((src, "coordinator") for src in [*pods, None]),  # clients, from anywhere
        ("coordinator", "verifier"),
        ("verifier", "drafter"),
        ("coordinator", "drafter"),
    }
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    for role, port in ROLES.items():  # Prometheus scrapes the metrics port and nothing else
        assert _allowed(policies, {}, pods[role], 9464, src_ns=monitoring)
        assert _allowed(policies, {}, pods[role], port, src_ns=monitoring) == (role == "coordinator")
        assert not _allowed(policies, {}, pods[role], 9464, src_ns={"kubernetes.io/metadata.name": "default"})
    assert _allowed(policies, pods["drafter"], pods["otel-collector"], 4317)
