"""The Kubernetes manifests: one overlay per drafter placement (`specsplit.rpc.placement`) and the CPU demo.
Every overlay builds, validates offline against the Kubernetes schemas, runs commands the specsplit
CLI accepts with the overlay's placement, and says what docs/deployment.md promises (the coordinator
beside its verifier, probes, GPUs, headless drafters and their autoscaler, network policies)."""

from __future__ import annotations

import inspect
import re

import kubernetes_validate
import pytest
import yaml
from deploy_tools import K8S, OVERLAYS, by_kind, dockerfile_exec_form, kustomize

from specsplit.cli.commands import parse_args
from specsplit.cli.launcher import METRICS_PORT_OFFSETS, LocalCluster
from specsplit.rpc.placement import DEFAULT_PLACEMENT, PLACEMENTS, resolve_placement
from specsplit.runtime.kv_cache_size import service_shares
from specsplit.verifier.drafter_pool import parse_targets

# overlay -> the drafter placement it deploys
PLACEMENT = {"colocated": "colocated", "pooled": "pooled", "pooled-tp": "pooled", "cpu-demo": "pooled"}
POOLED = [o for o, p in PLACEMENT.items() if p == "pooled"]
GPU = {"colocated", "pooled", "pooled-tp"}
# 1.27: the oldest release with native gRPC probes (GA); and the newest.
K8S_VERSIONS = ["1.27", kubernetes_validate.latest_version()]
SERVER, DRAFTER = "specsplit-server", "specsplit-drafter"


def render(overlay: str) -> tuple[dict, ...]:
    return kustomize(str(K8S / "overlays" / overlay))


def config(docs) -> dict[str, str]:
    (data,) = [d["data"] for n, d in by_kind(docs, "ConfigMap").items() if n.startswith("specsplit-config-")]
    return data


def pod(docs, deployment: str) -> dict:
    return by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]


def specsplit_containers(docs) -> list[tuple[str, dict]]:
    """(Deployment name, container) for every container running a specsplit image."""
    return [
        (name, c)
        for name, dep in by_kind(docs, "Deployment").items()
        for c in dep["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("specsplit-")
    ]


def image_role(container: dict) -> str:
    return container["image"].split(":")[0].removeprefix("specsplit-")


def argv(container: dict, docs) -> list[str]:
    """What the container runs, as `specsplit ARGV`: its command (else the image's ENTRYPOINT), then its
    args with $(VAR) taken from the specsplit-config ConfigMap."""
    command = container.get("command") or dockerfile_exec_form(image_role(container), "ENTRYPOINT")
    assert command[0] == "specsplit"
    data = config(docs)
    return [*command[1:], *(re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in container["args"])]


def parsed(container: dict, docs):
    """The container's command line as the specsplit CLI parses it (a bad flag exits: fails the test)."""
    return parse_args(argv(container, docs))


def by_name(containers: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in containers}


def test_there_is_an_overlay_for_each_placement_and_the_cpu_demo():
    assert set(OVERLAYS) == set(PLACEMENT)
    assert set(PLACEMENT.values()) == set(PLACEMENTS)
    assert not (K8S / "overlays" / "gpu").exists()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_builds_its_placement(overlay):
    docs = render(overlay)
    pooled = PLACEMENT[overlay] == "pooled"
    drafters = {DRAFTER} if pooled else set()
    assert set(by_kind(docs, "Deployment")) == {SERVER, "specsplit-otel-collector", *drafters}
    assert set(by_kind(docs, "Service")) == {"specsplit-coordinator", "specsplit-otel-collector", *drafters}
    assert set(by_kind(docs, "PodDisruptionBudget")) == {SERVER, *drafters}
    assert set(by_kind(docs, "HorizontalPodAutoscaler")) == drafters
    assert len(by_kind(docs, "Namespace")) == 1
    assert config(docs)["SPECSPLIT_NUM_SPECULATIVE_TOKENS"]
    # the client-facing Service and the serving pod's budget select the serving pod
    labels = by_kind(docs, "Deployment")[SERVER]["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "server"
    assert by_kind(docs, "Service")["specsplit-coordinator"]["spec"]["selector"].items() <= labels.items()
    assert by_kind(docs, "PodDisruptionBudget")[SERVER]["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_against_the_kubernetes_schemas(overlay, version):
    for doc in render(overlay):
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_rejects_an_unknown_field():
    broken = yaml.safe_load(yaml.safe_dump(by_kind(render("pooled"), "Deployment")[SERVER]))
    container = broken["spec"]["template"]["spec"]["containers"][1]
    container["livenesProbe"] = container.pop("livenessProbe")  # a typo kubectl apply would reject
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_command_the_cli_accepts_with_the_overlays_placement(overlay):
    docs = render(overlay)
    placement, device = PLACEMENT[overlay], config(docs)["SPECSPLIT_DEVICE"]
    resolved = {}
    for name, c in specsplit_containers(docs):
        assert {e["configMapRef"]["name"] for e in c["envFrom"]} == {
            n for n in by_kind(docs, "ConfigMap") if n.startswith("specsplit-config-")
        }
        args = parsed(c, docs)
        if args.command == "up":
            assert placement == "colocated" and name == SERVER
            resolved["up"] = resolve_placement(args.placement, args.device, args.hidden_transport)
        elif args.role in ("verifier", "drafter"):
            assert args.device == device
            resolved[args.role] = resolve_placement(args.placement, args.device, args.hidden_transport)
    if placement == "colocated":
        # one process manager for the three services, on the GPU: Unix sockets and CUDA IPC
        assert set(resolved) == {"up"} and len(specsplit_containers(docs)) == 1
        assert resolved["up"].name == "colocated" and resolved["up"].hidden_transport == "cuda_ipc"
    else:
        # the verifier refuses a drafter whose transport differs; the HPA scales drafters, which only grpc serves
        assert set(resolved) == {"verifier", "drafter"} and resolved["verifier"] == resolved["drafter"]
        assert resolved["verifier"].name == "pooled" and resolved["verifier"].hidden_transport == "grpc"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_openai_compatible_http_api_is_served_and_exposed_on_8000(overlay):
    """The coordinator serves the HTTP API by default in every overlay and in the image (`serve` and `up` leave it
    off unless given --http-port): its container runs --http-port 8000, names that port, and the client Service
    carries it."""
    docs = render(overlay)
    coordinators = [(n, c) for n, c in specsplit_containers(docs) if parsed(c, docs).command == "up"]
    coordinators += [
        (n, c) for n, c in specsplit_containers(docs) if getattr(parsed(c, docs), "role", "") == "coordinator"
    ]
    assert len(coordinators) == 1
    _, container = coordinators[0]
    assert parsed(container, docs).http_port == 8000
    assert {"name": "http", "containerPort": 8000} in container["ports"]
    service = by_kind(docs, "Service")["specsplit-coordinator"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "appProtocol": "http"} in service["spec"]["ports"]
    cmd = dockerfile_exec_form("coordinator", "CMD")
    assert cmd[cmd.index("--http-port") + 1] == "8000"
    assert (
        parse_args(["up"]).http_port is None
        and parse_args(["serve", "coordinator", "--model", "m", "--verifier", "v:1"]).http_port is None
    )


def test_kubernetes_uses_the_same_placement_defaults_as_up_and_serve():
    assert DEFAULT_PLACEMENT == "colocated"
    assert parse_args(["up", "--model", "m"]).placement == DEFAULT_PLACEMENT
    for role in ("verifier", "drafter"):
        assert parse_args(["serve", role, "--model", "m"]).placement == DEFAULT_PLACEMENT
    # the co-located overlay leaves the placement at its default or names it; it picks no transport
    (container,) = pod(render("colocated"), SERVER)["containers"]
    assert {a for a in container["args"] if a.startswith("--placement")} <= {"--placement=colocated"}
    assert not any(a.startswith("--hidden-transport") for a in container["args"])
    # the pooled ones name their placement on both model servers (the default is colocated)
    for overlay in POOLED:
        docs = render(overlay)
        for c in (by_name(pod(docs, SERVER)["containers"])["verifier"], pod(docs, DRAFTER)["containers"][0]):
            assert "--placement=pooled" in c["args"]


@pytest.mark.parametrize("overlay", POOLED)
def test_the_coordinator_reaches_its_verifier_in_its_pod_on_the_shared_socket_volume(overlay):
    docs = render(overlay)
    spec = pod(docs, SERVER)
    containers = by_name(spec["containers"])
    assert set(containers) == {"coordinator", "verifier"}
    coordinator, verifier = parsed(containers["coordinator"], docs), parsed(containers["verifier"], docs)
    assert coordinator.role == "coordinator" and verifier.role == "verifier"
    assert coordinator.verifier == f"127.0.0.1:{verifier.port}" and coordinator.verifier_rpc == "local"
    assert verifier.host == "127.0.0.1"  # nothing outside the pod calls the verifier
    # the verifier serves VerifyStream in --socket-dir; the coordinator finds that path on its own filesystem
    mounts = {
        name: {m["mountPath"]: m["name"] for m in c["volumeMounts"] if not m.get("subPath")}
        for name, c in containers.items()
    }
    volume = mounts["verifier"][verifier.socket_dir]
    assert mounts["coordinator"].get(verifier.socket_dir) == volume
    assert "emptyDir" in by_name(spec["volumes"])[volume]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_serving_deployment_is_recreated_never_rolled(overlay):
    spec = by_kind(render(overlay), "Deployment")[SERVER]["spec"]
    assert spec["strategy"] == {"type": "Recreate"}  # one coordinator per verifier
    assert spec["replicas"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_have_probes_limits_non_root_and_graceful_shutdown(overlay):
    docs = render(overlay)
    for name, c in specsplit_containers(docs):
        args, spec = parsed(c, docs), pod(docs, name)
        role = "coordinator" if args.command == "up" else args.role
        service = f"specsplit.v1.{role.capitalize()}"
        ports = {p["containerPort"] for p in c["ports"]} - {getattr(args, "http_port", None)}  # HTTP: its own test
        if args.command == "up":
            assert ports == {args.port, *(args.metrics_port + o for o in METRICS_PORT_OFFSETS.values())}
        else:
            assert ports == {args.port, args.metrics_port} - ({args.port} if args.host == "127.0.0.1" else set())
        if args.host == "0.0.0.0":  # the kubelet's gRPC probes dial the pod IP
            for probe in ("startupProbe", "readinessProbe"):  # ready only once the weights are loaded
                assert c[probe]["grpc"] == {"port": args.port, "service": service}
            assert c["livenessProbe"]["grpc"]["port"] == args.port
        else:  # loopback only: the image's health check, from inside the container
            assert args.host == "127.0.0.1"
            health = dockerfile_exec_form(image_role(c), "HEALTHCHECK")
            assert health[2:] == [f"127.0.0.1:{args.port}", service]
            for probe in ("startupProbe", "readinessProbe"):
                assert c[probe]["exec"]["command"] == health and c[probe]["timeoutSeconds"] >= 3
            assert c["livenessProbe"]["exec"]["command"] == health[:3]
        startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        assert startup >= 600 and startup >= getattr(args, "startup_timeout", 0)  # weights load
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
        assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
        # a writable /tmp of its own ($TMPDIR: Triton's cache, `up`'s sockets)
        (tmp,) = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert "emptyDir" in by_name(spec["volumes"])[tmp]
        # the drain after SIGTERM fits in the pod's grace period
        if args.command == "up":  # `up` stops the coordinator, then the others, killing any still running after grace_s
            drain = 2 * inspect.signature(LocalCluster.stop).parameters["grace_s"].default
        else:  # NOT_SERVING, --shutdown-delay for endpoints to catch up, --shutdown-grace for calls in flight
            assert args.shutdown_delay > 0
            drain = args.shutdown_delay + args.shutdown_grace
        assert spec["terminationGracePeriodSeconds"] >= pre_stop_wait(c) + drain + 5
    for name in by_kind(docs, "Deployment"):  # each pod's containers keep their /tmp apart
        mounts = [m for c in pod(docs, name)["containers"] for m in c.get("volumeMounts", [])]
        tmps = [m["name"] for m in mounts if m["mountPath"] == "/tmp"]
        assert len(tmps) == len(set(tmps))


def pre_stop_wait(container: dict) -> float:
    """Seconds the container's preStop hook sleeps before Kubernetes sends it SIGTERM (0: none)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    (seconds,) = re.fullmatch(r"import time; time.sleep\((\d+(?:\.\d+)?)\)", hook["exec"]["command"][-1]).groups()
    return float(seconds)


@pytest.mark.parametrize("tree", ["pooled", "cpu-demo"])
def test_the_pooled_verifier_outlives_its_coordinators_drain(tree):
    docs = render(tree)
    containers = by_name(pod(docs, SERVER)["containers"])
    coordinator = parsed(containers["coordinator"], docs)
    assert pre_stop_wait(containers["verifier"]) >= coordinator.shutdown_delay + coordinator.shutdown_grace
    assert pre_stop_wait(containers["coordinator"]) == 0


def gpus(container: dict) -> int:
    limits, requests = container["resources"].get("limits", {}), container["resources"].get("requests", {})
    assert limits.get("nvidia.com/gpu") == requests.get("nvidia.com/gpu")
    return limits.get("nvidia.com/gpu", 0)


def test_colocated_pod_has_exactly_one_gpu_for_its_three_services():
    docs = render("colocated")
    (container,) = pod(docs, SERVER)["containers"]
    assert gpus(container) == 1 and container["image"].endswith("-cuda")
    assert sum(gpus(c) for name in by_kind(docs, "Deployment") for c in pod(docs, name)["containers"]) == 1
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm", "/tmp"}


def test_verifier_and_drafter_on_one_gpu_take_shares_that_add_up_below_1():
    """The co-located pod's `up` splits its --gpu-memory-utilization between the two model servers on its one GPU;
    a pooled model server has a GPU of its own and takes the default."""
    (container,) = pod(render("colocated"), SERVER)["containers"]
    args = parse_args(argv(container, render("colocated")))
    shares = service_shares(args.gpu_memory_utilization, {"verifier": args.device, "drafter": args.device})
    assert shares == {"verifier": 0.8, "drafter": 0.1} and sum(shares.values()) < 1
    docs = render("pooled")
    for c in (by_name(pod(docs, SERVER)["containers"])["verifier"], pod(docs, DRAFTER)["containers"][0]):
        assert gpus(c) == 1 and parsed(c, docs).gpu_memory_utilization is None  # 0.9 of its own GPU


def test_pooled_overlay_gives_the_verifier_and_each_drafter_a_gpu_and_the_coordinator_none():
    docs = render("pooled")
    server = by_name(pod(docs, SERVER)["containers"])
    assert gpus(server["verifier"]) == 1 and gpus(server["coordinator"]) == 0
    (drafter,) = pod(docs, DRAFTER)["containers"]
    assert gpus(drafter) == 1
    assert server["verifier"]["image"].endswith("-cuda") and drafter["image"].endswith("-cuda")
    assert gpus(pod(docs, "specsplit-otel-collector")["containers"][0]) == 0


def test_tp_overlay_gives_the_verifier_a_gpu_per_rank_shm_for_nccl_and_each_drafter_its_own_gpu():
    docs = render("pooled-tp")
    server = by_name(pod(docs, SERVER)["containers"])
    args = parsed(server["verifier"], docs)
    assert args.tensor_parallel_size > 1 and gpus(server["verifier"]) == args.tensor_parallel_size
    assert gpus(server["coordinator"]) == 0
    (drafter,) = pod(docs, DRAFTER)["containers"]
    assert gpus(drafter) == 1
    (shm,) = [v for v in pod(docs, SERVER)["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"].endswith("Gi")
    assert int(shm["emptyDir"]["sizeLimit"][:-2]) >= 16  # NCCL's buffers for 8 ranks
    assert "/dev/shm" in {m["mountPath"] for m in server["verifier"]["volumeMounts"]}


def test_cpu_demo_has_no_gpu_and_uses_local_images():
    docs = render("cpu-demo")
    assert "nvidia.com/gpu" not in str(docs)
    assert config(docs)["SPECSPLIT_DEVICE"] == "cpu"
    for _, c in specsplit_containers(docs):
        if image_role(c) != "coordinator":
            assert c["image"].endswith("-cpu")
    for name in by_kind(docs, "Deployment"):
        for c in pod(docs, name)["containers"]:  # every container, not only the first of a pod
            assert c["imagePullPolicy"] == "IfNotPresent", (name, c["name"])


@pytest.mark.parametrize("overlay", sorted(GPU))
def test_gpu_overlays_read_the_model_from_the_volume(overlay):
    docs = render(overlay)
    data = config(docs)
    assert data["SPECSPLIT_DEVICE"].startswith("cuda") and data["SPECSPLIT_DTYPE"] == "bfloat16"
    assert data["SPECSPLIT_MODEL"].startswith("/models/")
    assert set(by_kind(docs, "PersistentVolumeClaim")) == {"specsplit-model"}
    for name, c in specsplit_containers(docs):  # the coordinator too: it reads the tokenizer
        spec = pod(docs, name)
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"]
        claim = by_name(spec["volumes"])[mount["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": "specsplit-model", "readOnly": True}


@pytest.mark.parametrize("overlay", POOLED)
def test_the_verifier_finds_drafter_replicas_through_a_headless_service(overlay):
    docs = render(overlay)
    drafter_svc = by_kind(docs, "Service")[DRAFTER]
    assert drafter_svc["spec"]["clusterIP"] == "None"
    verifier = by_name(pod(docs, SERVER)["containers"])["verifier"]
    assert "--drafter=$(SPECSPLIT_DRAFTERS)" in verifier["args"]
    (target,) = parse_targets(config(docs)["SPECSPLIT_DRAFTERS"])
    (drafter,) = pod(docs, DRAFTER)["containers"]
    port = parsed(drafter, docs).port
    assert target == f"dns:///{DRAFTER}:{port}" and drafter_svc["spec"]["ports"][0]["port"] == port


@pytest.mark.parametrize("overlay", POOLED)
def test_drafter_autoscaler_watches_metrics_the_prometheus_adapter_serves(overlay):
    docs = render(overlay)
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[DRAFTER]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": DRAFTER}
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    assert by_kind(docs, "PodDisruptionBudget")[DRAFTER]["spec"]["minAvailable"] == 1
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_open_the_coordinator_to_clients_and_drafters_to_the_serving_pod_only(overlay):
    docs = render(overlay)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods = {
        name.removeprefix("specsplit-"): dep["spec"]["template"]["metadata"]["labels"]
        for name, dep in by_kind(docs, "Deployment").items()
    }
    grpc_ports = {"server": [50051, 8000, 50052, 50053], "drafter": [50053], "otel-collector": []}
    allowed = {
        (src, dst, port)
        for src in [*pods, None]
        for dst in pods
        for port in grpc_ports[dst]
        if _allowed(policies, pods.get(src), pods[dst], port)
    }
    expected = {(src, "server", port) for src in [*pods, None] for port in (50051, 8000)}  # clients, from anywhere
    if PLACEMENT[overlay] == "pooled":
        expected.add(("server", "drafter", 50053))  # the verifier's ProposeStream
    assert allowed == expected
    monitoring, default = ({"kubernetes.io/metadata.name": ns} for ns in ("monitoring", "default"))
    for name, c in specsplit_containers(docs):  # Prometheus scrapes the metrics ports and nothing else
        dst = pods[name.removeprefix("specsplit-")]
        for p in c["ports"]:
            is_metrics = p["name"].startswith("metrics")
            assert _allowed(policies, {}, dst, p["containerPort"], src_ns=monitoring) == (
                is_metrics or p["containerPort"] in (50051, 8000)
            )
            if is_metrics:
                assert not _allowed(policies, {}, dst, p["containerPort"], src_ns=default)
    for src in pods:
        assert _allowed(policies, pods[src], pods["otel-collector"], 4317)
