"""A real Prometheus server for the tests (Debian's `prometheus` package, which `scripts/test` installs when missing,
as root), scraping services on 127.0.0.1 every second; the Prometheus adapter's rules
(docker/k8s/prometheus-adapter/values.yaml) rendered into the queries the adapter sends for the drafter HPA's custom
metrics; and a pooled cluster whose three services it scrapes as pods (`ScrapedCluster`), with the latencies the
services measured for the traffic a test sends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.proto import coordinator_pb2, coordinator_pb2_grpc
from specsplit.rpc.process import free_port

ROOT = Path(__file__).resolve().parents[2]
ADAPTER_VALUES = ROOT / "docker" / "k8s" / "prometheus-adapter" / "values.yaml"
NAMESPACE = "specsplit-test"  # the `namespace` label every scraped target gets, as the kubernetes-pods job sets it
# The latency histograms (Prometheus series name, less `_bucket`/`_sum`/`_count`) by the service that exports them.
LATENCY_HISTOGRAMS = {
    "specsplit_drafter_propose_latency_seconds": "drafter",
    "specsplit_verifier_verify_duration_seconds": "verifier",
    "specsplit_iteration_duration_seconds": "coordinator",
    "specsplit_time_to_first_token_seconds": "coordinator",
    "specsplit_time_per_output_token_seconds": "coordinator",
}


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail(
            "prometheus not found: install Debian's package (as root: apt-get update && apt-get install -y "
            "--no-install-recommends prometheus; scripts/test does as root), or put a prometheus binary on PATH"
        )
    return found


class Prometheus:
    """`prometheus` scraping `targets` (job name -> (host:port, pod label)) every second, each series labelled with
    `namespace` and its target's `pod`, as the adapter's rules expect; storage in `directory`. A context manager."""

    def __init__(self, directory: Path, targets: dict[str, tuple[str, str]]):
        self.directory = Path(directory)
        self.targets = targets
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        binary = prometheus_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [{"targets": [address], "labels": {"namespace": NAMESPACE, "pod": pod}}],
                }
                for job, (address, pod) in self.targets.items()
            ],
        }
        (self.directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.directory / "prometheus.log", "w")  # noqa: SIM115 (closed by __exit__)
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready(timeout_s=60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        return "\n".join((self.directory / "prometheus.log").read_text(errors="replace").splitlines()[-n:])

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query through the HTTP API: each series' value by its sorted labels."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in body["data"]["result"]}

    def scalar(self, expr: str) -> float | None:
        """The value of a query that selects one series (None when it selects none)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} selects {len(result)} series: {result}"
        return next(iter(result.values()), None)


def adapter_rules() -> dict[str, dict]:
    """The Prometheus adapter's custom rules by the metric name they serve."""
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    return {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}


def adapter_query(metric: str, pods: list[str], group_by: str = "pod") -> str:
    """The query the adapter sends for custom metric `metric` of `pods` in NAMESPACE: the rule's metricsQuery with
    `<<.Series>>` the series its seriesQuery selects, `<<.LabelMatchers>>` the namespace and pods, `<<.GroupBy>>` the
    label that names a pod."""
    rule = adapter_rules()[metric]
    series = rule["seriesQuery"].split("{", 1)[0]
    matchers = f'namespace="{NAMESPACE}",pod=~"{"|".join(pods)}"'
    query = rule["metricsQuery"]
    for template, value in (("<<.Series>>", series), ("<<.LabelMatchers>>", matchers), ("<<.GroupBy>>", group_by)):
        assert template in query, f"{metric}'s metricsQuery has no {template}: {query}"
        query = query.replace(template, value)
    return query


class ScrapedCluster:
    """A pooled LocalCluster (the drafter a process of its own, as a drafter Deployment's pod) whose services export
    Prometheus metrics on ports of their own, scraped by a `Prometheus` as pods `POD[role]`. A context manager;
    `role_commands` as LocalCluster's (its modules found from the repository root)."""

    POD = {role: f"specsplit-{role}-0" for role in ("coordinator", "verifier", "drafter")}

    def __init__(self, checkpoint: Path, directory: Path, role_commands: dict[str, list[str]] | None = None):
        self.ports = {role: free_port() for role in self.POD}
        self.cluster = LocalCluster(
            checkpoint,
            num_speculative_tokens=3,
            log_dir=directory / "logs",
            placement="pooled",
            # A fixed k: every iteration proposes (adaptive speculation stops asking the tiny model's drafter).
            coordinator_args=["--no-adaptive", "--metrics-port", str(self.ports["coordinator"])],
            verifier_args=["--metrics-port", str(self.ports["verifier"])],
            drafter_args=["--metrics-port", str(self.ports["drafter"])],
            role_commands=role_commands,
            env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )
        targets = {role: (f"127.0.0.1:{port}", self.POD[role]) for role, port in self.ports.items()}
        self.prometheus = Prometheus(directory / "prometheus", targets)

    def __enter__(self) -> ScrapedCluster:
        self.cluster.start()
        try:
            self.prometheus.__enter__()
        except BaseException:
            self.cluster.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.prometheus.__exit__()
        finally:
            self.cluster.stop()

    def exported(self, series: str) -> tuple[float, float]:
        """(sum, count) of a latency histogram as its service exports it now."""
        port = self.ports[LATENCY_HISTOGRAMS[series]]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return values[f"{series}_sum"], values[f"{series}_count"]

    def _wait_scraped(self, timeout_s: float = 60.0) -> dict[str, tuple[float, float]]:
        """Each latency histogram's (sum, count) once Prometheus has scraped the count its service exports (read
        again until they agree: a service may still record the last iteration's observations)."""
        deadline = time.monotonic() + timeout_s
        now = {}
        for series, role in LATENCY_HISTOGRAMS.items():
            query = f'{series}_count{{pod="{self.POD[role]}"}}'
            while (scraped := self.prometheus.scalar(query)) != (exported := self.exported(series))[1]:
                assert time.monotonic() < deadline, f"{query} = {scraped}, exported {exported[1]}, after {timeout_s} s"
                time.sleep(0.2)
            now[series] = exported
        return now

    def iteration_timings(self) -> dict[int, object]:
        """The coordinator's timings of its recent iterations (GetStats), by iteration."""
        with grpc.insecure_channel(self.cluster.address) as channel:
            stats = coordinator_pb2_grpc.CoordinatorStub(channel).GetStats(
                coordinator_pb2.GetStatsRequest(include_iterations=True), timeout=30
            )
        return {t.iteration: t for t in stats.iterations}

    def measure(self, send: Callable[[Client], None]) -> dict:
        """Runs `send` with a client, then waits until Prometheus has scraped all it caused. Returns `means`: each
        latency histogram's mean over the observations `send` caused, from the services' own _sum and _count; and
        `proposes`: the latency of each Propose of those iterations as the drafter timed it (received to replied,
        which the verifier passes on in each iteration's timing). One generation first puts every histogram's
        series in Prometheus, so that rate() over a window sees what `send` adds to them."""
        with Client(self.cluster.address, timeout=120) as client:
            client.generate(prompt_token_ids=[1, 2], max_tokens=4, ignore_eos=True)
            before = self._wait_scraped()
            earlier = self.iteration_timings()
            send(client)
        after = self._wait_scraped()
        means = {}
        for series in LATENCY_HISTOGRAMS:
            (sum0, count0), (sum1, count1) = before[series], after[series]
            assert count1 > count0, f"{series}: no observation from the traffic"
            means[series] = (sum1 - sum0) / (count1 - count0)
        timings = [t.verifier for i, t in self.iteration_timings().items() if i not in earlier]
        proposes = [(t.drafter_replied_ns - t.drafter_received_ns) / 1e9 for t in timings if t.drafter_received_ns]
        return {"means": means, "proposes": proposes}
