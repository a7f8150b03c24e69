"""Live SLO analysis of rollout steps: the real Prometheus server (Debian's package) scraping
exporters that publish vLLM's own metric names, judged with the PromQL the rollout runs."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pipeline.core.errors import PrometheusError
from pipeline.core.specs import RolloutSpec, SloSpec, load_spec
from pipeline.records.events import detail_of
from pipeline.release import analysis, local_engines, local_prometheus, local_target
from pipeline.release.registry import ReleaseData
from testkit import http_stub
from tests.conftest import TINY_SPEC
from tests.test_registry import chosen

BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class FakeEngine:
    """An HTTP /metrics endpoint with vLLM's TTFT / TPOT histograms and finished-request counter,
    fed `rate` requests a second at the latencies set on it (a thread), like a replica under load."""

    def __init__(self, ttft: float, tpot: float, rate: float = 20):
        self.ttft, self.tpot, self.rate, self.failed_share, self.http_failed_share = ttft, tpot, rate, 0.0, 0.0
        self.registry = CollectorRegistry()
        self.h_ttft = Histogram(analysis.TTFT, "ttft", buckets=BUCKETS, registry=self.registry)
        self.h_tpot = Histogram(analysis.TPOT, "tpot", buckets=BUCKETS, registry=self.registry)
        self.done = Counter(
            analysis.FINISHED.removesuffix("_total"), "finished", ["finished_reason"], registry=self.registry
        )
        # vLLM's API server's own count of answered requests (grouped status, as it exposes it)
        self.http = Counter(
            analysis.HTTP.removesuffix("_total"), "http", ["handler", "status", "method"], registry=self.registry
        )
        self.server = http_stub.serve(lambda: generate_latest(self.registry))
        self.port = self.server.server_address[1]
        self.stopping = threading.Event()
        threading.Thread(target=self._feed, daemon=True).start()

    def _feed(self) -> None:
        n = 0
        while not self.stopping.wait(1 / self.rate if self.rate else 0.1):
            if not self.rate:
                continue
            n += 1
            if self.http_failed_share and n % round(1 / self.http_failed_share) == 0:
                self.http.labels("/v1/completions", "5xx", "POST").inc()  # failed before the engine finished it
                continue
            self.h_ttft.observe(self.ttft)
            self.h_tpot.observe(self.tpot)
            failed = self.failed_share and n % round(1 / self.failed_share) == 0
            self.done.labels("abort" if failed else "length").inc()
            self.http.labels("/v1/completions", "2xx", "POST").inc()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prometheus(tmp_path):
    root = tmp_path / "prometheus"
    url = local_prometheus.ensure(root)
    yield root, url
    assert local_prometheus.stop(root)
    assert local_prometheus.url(root) is None


def test_a_step_passes_on_good_live_metrics_and_fails_with_its_evidence(prometheus):
    """Each case a release of its own beside the old one (release 1), all scraped together and judged
    after one window (one window instead of one per case: ~35 s less)."""
    root, url = prometheus
    slo = SloSpec(max_p90_ttft_ms=500, max_p90_tpot_ms=100)
    plan = RolloutSpec(steps=[0.5, 1.0], analysis_window="3s", min_requests=10, max_vs_live=3)
    old = FakeEngine(ttft=0.03, tpot=0.008)
    cases = {
        2: FakeEngine(ttft=0.04, tpot=0.009),  # good
        3: FakeEngine(ttft=0.8, tpot=0.15),  # a release that breaks the SLO under this load
        4: FakeEngine(ttft=0.04, tpot=0.009),  # aborts and errors the engine counted
        5: FakeEngine(ttft=0.04, tpot=0.009),  # HTTP 500s the engine never finished
        6: FakeEngine(ttft=0.04, tpot=0.009, rate=0),  # traffic flows, but none reaches the new release
        7: FakeEngine(ttft=0.8, tpot=0.009, rate=2),  # so slow that few finish
        8: FakeEngine(ttft=0.04, tpot=0.009),  # its engine gone before the window
        10: FakeEngine(ttft=0.03, tpot=0.008, rate=0),  # a quiet window: the old release of release 11
        11: FakeEngine(ttft=0.04, tpot=0.009, rate=0),
    }
    cases[4].failed_share = 0.25
    cases[5].http_failed_share = 0.25
    try:
        for release, engine in [(1, old), *cases.items()]:
            local_prometheus.scrape(root, release, "single", [engine.port])
        for release in [1, *cases]:
            local_prometheus.wait_scraped(url, release, 1)
        cases[8].stop()  # scraped down from here on
        time.sleep(3 + 2 * local_prometheus.SCRAPE_SECONDS)  # the window, and the scrapes closing it

        def judge(new: int, step: int, against: int = 1) -> analysis.StepAnalysis:
            return analysis.analyze(url, f'release="{new}"', f'release="{against}"', step, 0.5, 3, slo, plan)

        good = judge(2, 1)
        assert good.passed and not good.inconclusive, good.summary()
        q = good.queries
        # the quantile of the bucket holding every observation, interpolated by Prometheus itself
        assert 0.02 < q["new_p90_ttft"].value <= 0.05 and 0.005 < q["new_p90_tpot"].value <= 0.01
        assert q["new_requests"].value >= 10 and q["new_failed"].value == 0
        assert (
            'histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{release="2"}[3s])))'
            == (q["new_p90_ttft"].promql)
        )

        slow = judge(3, 2)
        assert not slow.passed
        assert any(r.startswith("p90 TTFT") and r.endswith("> SLO 500 ms") for r in slow.reasons), slow.reasons
        assert any(r.startswith("p90 TPOT") and r.endswith("> SLO 100 ms") for r in slow.reasons), slow.reasons
        assert any("x the old release's" in r for r in slow.reasons)  # and worse than the old one beside it
        assert "FAILED" in slow.summary() and "new p90 TTFT" in slow.summary()

        errors = judge(4, 3)
        assert not errors.passed and any("aborted or failed" in r for r in errors.reasons), errors.reasons

        # requests that failed at HTTP level (500s the engine never finished) count as failures too
        http_errors = judge(5, 3)
        assert http_errors.queries["new_http_errors"].value > 0, http_errors.summary()
        assert any("aborted or failed (HTTP 5xx:" in r for r in http_errors.reasons), http_errors.reasons

        quiet = judge(11, 4, against=10)  # nothing to judge, so no pass (fails closed)
        assert not quiet.passed and quiet.inconclusive, quiet.summary()
        assert any(r.startswith("inconclusive: 0 requests") for r in quiet.reasons), quiet.reasons
        assert "inconclusive (too little traffic)" in quiet.summary()
        # a reviewer who knows why may Continue it; unanswered, it stays an abort
        from pipeline.records.rollout import StepReview

        assert quiet.decided(StepReview(step=4, decision="continue", actor="sre")).passed
        assert not quiet.decided(StepReview(step=4, decision="continue", actor="nobody", by_default=True)).passed

        starved = judge(6, 5)  # the split is broken
        assert not starved.passed and any("fewer than 10" in r for r in starved.reasons), starved.reasons

        crawling = judge(7, 6)  # what did finish is judged on the SLO too
        assert any("fewer than 10" in r for r in crawling.reasons), crawling.reasons
        assert any(r.startswith("p90 TTFT") and r.endswith("> SLO 500 ms") for r in crawling.reasons), crawling.reasons

        down = judge(8, 6)
        assert not down.passed and any("engines of the new release are down" in r for r in down.reasons)
    finally:
        for engine in [old, *cases.values()]:
            engine.stop() if not engine.stopping.is_set() else None


def test_prometheus_refusing_a_query_names_it(prometheus):
    _, url = prometheus
    with pytest.raises(PrometheusError, match=r"refused sum\(rate\(x\[\]\)\)"):
        analysis.query(url, "sum(rate(x[]))")


def test_rollout_steps_are_validated_and_split_the_front_by_weight():
    with pytest.raises(ValueError, match="fractions must increase"):
        RolloutSpec(steps=[0.5, 0.2, 1.0])
    with pytest.raises(ValueError, match="the last step must be 1.0"):
        RolloutSpec(steps=[0.1, 0.5])
    assert load_spec(TINY_SPEC).spec.rollout.steps == [0.5, 1.0]
    old = local_target.Deployment(release_id=1, layout="single", model_dir="m", pgids=[1], ports=[9001], log_dir="l")
    new = old.model_copy(update={"release_id": 2, "ports": [9002, 9003]})
    assert local_target.split(old, new, 0.1) == {9001: 90, 9002: 5, 9003: 5}
    assert local_target.split(old, new, 0.5) == {9001: 50, 9002: 25, 9003: 25}
    assert local_target.split(old, new, 1.0) == {9002: 1, 9003: 1}


def test_a_step_is_a_weighted_split_that_nginx_accepts(tmp_path):
    import subprocess

    from pipeline.stages import serving

    conf = serving.write_nginx_conf(tmp_path, 18080, [9001, 9002], weights={9001: 90, 9002: 10})
    text = conf.read_text()
    assert "server 127.0.0.1:9001 weight=90;server 127.0.0.1:9002 weight=10;" in text and "least_conn" not in text
    check = subprocess.run([serving.nginx_binary(), "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True)
    assert check.returncode == 0, check.stderr
    assert "least_conn;" in serving.write_nginx_conf(tmp_path, 18080, [9001, 9002]).read_text()


def test_the_front_log_counts_what_the_new_engines_failed_even_where_a_retry_saved_the_client():
    """A step's front: requests at three engines through the real nginx, one answering 500, one
    not listening. The access log counts each engine's attempts and failures, the refused ones
    too, which nginx retried on another engine so no client saw them; and such failures above
    rollout.max_error_fraction fail a step the PromQL analysis passed."""
    import subprocess
    import urllib.error
    import urllib.request

    from pipeline.records.rollout import StepAnalysis
    from pipeline.stages import serving
    from testkit.s3server import free_port
    from tests.k8s_fake import dead_url

    good = http_stub.serve(lambda: b"{}", "application/json")
    bad = http_stub.serve(lambda: b"{}", "application/json", status=500)
    ports = {"good": good.server_address[1], "bad": bad.server_address[1], "dead": int(dead_url().rsplit(":", 1)[1])}
    root = local_target.state_dir("front-log") / "front"
    root.mkdir(parents=True, exist_ok=True)
    front = free_port()
    conf = serving.write_nginx_conf(
        root, front, list(ports.values()), access_log=True, weights=dict.fromkeys(ports.values(), 1)
    )
    nginx = subprocess.Popen([serving.nginx_binary(), "-c", str(conf), "-p", str(root)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not serving.healthy(f"http://127.0.0.1:{front}") and time.monotonic() < deadline:
            time.sleep(0.1)
        since, seen = time.time(), []
        for _ in range(30):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{front}/v1/completions", data=b"{}", timeout=10) as r:
                    seen.append(r.status)
            except urllib.error.HTTPError as exc:
                seen.append(exc.code)
        time.sleep(0.2)
        counts = {n: local_target.front_attempts("front-log", [p], since, time.time()) for n, p in ports.items()}
    finally:
        nginx.terminate()
        nginx.wait()
        good.shutdown()
        bad.shutdown()
    assert counts["good"][0] >= 5 and counts["good"][1] == 0
    assert counts["bad"][0] >= 5 and counts["bad"][1] == counts["bad"][0] == seen.count(500)
    assert counts["dead"][0] >= 1 and counts["dead"][1] == counts["dead"][0]  # refused, retried: nobody saw it
    assert seen.count(502) == 0 and len(seen) == 30
    passed = StepAnalysis(step=1, fraction=0.5, window_s=6, passed=True, queries={})
    rollout = load_spec(TINY_SPEC).spec.rollout
    judged = analysis.with_front(passed, *counts["bad"], rollout)
    assert not judged.passed and judged.reasons == [
        f"100.0% of the front's requests to the new release failed ({counts['bad'][1]} of {counts['bad'][0]}: "
        f"5xx or no answer) > {rollout.max_error_fraction:.1%}"
    ]
    assert judged.queries["front_failed"].value == counts["bad"][1]
    assert analysis.with_front(passed, *counts["good"], rollout).passed


def test_a_new_release_starts_on_cores_the_live_one_leaves_free(monkeypatch):
    from pipeline.stages import serving

    loaded = load_spec(TINY_SPEC)
    single, two = loaded.spec.layouts
    monkeypatch.setattr(serving, "all_cores", lambda: [0, 1])
    assert local_engines.cores_beside(loaded.hardware, single, [[0]]) == [[1]]
    assert local_engines.cores_beside(loaded.hardware, single, [[1]]) == [[0]]
    assert local_engines.cores_beside(loaded.hardware, two, [[0]]) is None  # too few free: the usual cores
    assert local_engines.cores_beside(loaded.hardware, single, []) is None
    commands = serving.build_commands(loaded.spec, loaded.hardware, single, "/m", 9000, [[1]])
    assert commands[0].devices == [1] and commands[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_rollout_plan_keeps_the_peak_held_at_every_step_within_the_spare_budget(spec_file, capsys):
    from pipeline import cli
    from pipeline.release import rollout_plan
    from tests.conftest import PROD_SPEC

    loaded = load_spec(PROD_SPEC)  # peak 120 req/s + 20% headroom = 144; steps 10/50/100%, 5 min windows
    new = rollout_plan.Side(layout="tp4-ep4-x2", rate_per_server=18.1, load_seconds=600)
    old = rollout_plan.Side(layout="tp8-ep8", rate_per_server=12.5, load_seconds=540)
    p = rollout_plan.plan(loaded, new, old)
    assert (p.need_rps, p.live_servers, p.new_servers) == (144, 12, 8)  # ceil(144/12.5), ceil(144/18.1)
    rows = [(s.fraction, s.old_servers, s.new_servers, s.at_once, s.waves) for s in p.steps]
    # 10%: ceil(14.4/18.1)=1 new, ceil(129.6/12.5)=11 old; 50%: ceil(72/18.1)=4, ceil(72/12.5)=6
    assert rows == [(0.1, 11, 1, 13, 1), (0.5, 6, 4, 13, 3), (1.0, 0, 8, 11, 4)]
    assert all(s.old_holds_rps >= s.old_share_rps and s.new_holds_rps >= s.new_share_rps for s in p.steps)
    assert max(s.at_once for s in p.steps) <= p.live_servers + p.spare_servers and p.feasible
    assert [s.seconds for s in p.steps] == [900, 3 * 600 + 300, 4 * 600 + 300] and p.expected_seconds == 5700
    # while a step is judged the old release keeps what the 12 + 1 budget leaves it: all 12 beside 1 new
    # (an abort is instant), 9 beside 4, 5 beside 8; an abort reloads the rest
    assert [(s.old_kept, s.abort_reloads) for s in p.steps] == [(12, 0), (9, 3), (5, 7)]
    # a rollback after this rollout: within the 30 min keep window the 5 kept run, 7 reload one a wave
    # (the spare budget) at 9 min each; after it all 12 do
    assert (p.keep_window_s, p.rollback_reloads_in_window, p.rollback_reloads_after) == (1800, 7, 12)
    assert (p.rollback_in_window_s, p.rollback_after_s) == (7 * 540, 12 * 540)
    # an abort at 50% reloads 3 old servers in the widest waves the 12 + 1 budget leaves as the new
    # release gives back what its share no longer needs (controller.reload_wave): 2 waves of 9 min
    assert [s.abort_waves for s in p.steps] == [0, 2, 4] and "3 reloads (18.0 min)" in rollout_plan.table(p)
    # old servers scaled away drain first and hold their GPUs until gone: counted against the budget,
    # so each wave that needs their room waits (3 at 50%, 4 at 100%; all 12 stop, the last 5 after the
    # keep window)
    assert [(s.terminating, s.drain_waits) for s in p.steps] == [(0, 0), (3, 3), (9, 4)]
    assert p.drain_bound_s == 615 and "'waits': waves whose new servers wait for such a drain" in rollout_plan.table(p)
    instant = loaded.model_copy(deep=True)
    instant.spec.rollout.instant_abort = True  # refused: it needs 8 spare servers at the last step
    held = rollout_plan.plan(instant, new, old)
    assert not held.feasible and [s.ok for s in held.steps] == [True, False, False]
    assert held.steps[2].problem == (
        "rollout.instant_abort keeps all 12 old servers beside 8 new: rollout.spare_servers must be at least 8 (is 1)"
    )
    instant.spec.rollout.spare_servers = 8  # held: every abort is instant
    held = rollout_plan.plan(instant, new, old)
    assert held.feasible and all(s.abort_reloads == 0 for s in held.steps)

    # servers slower than the live ones (11 vs 12.5 req/s): every step's end fits 12 + 2, but on the way
    # to 100% the 8 new servers up hold 8/14 of the traffic, the old share still needs 6: no room for
    # another; refused here, as the controller would halfway
    slower = loaded.model_copy(deep=True)
    slower.spec.rollout.spare_servers = 2
    on_paper = rollout_plan.plan(slower, new.model_copy(update={"rate_per_server": 11.0}), old)
    assert not on_paper.feasible and [s.ok for s in on_paper.steps] == [True, True, False]
    assert on_paper.steps[2].problem == (
        "6 old servers hold the old share while 8 new run; rollout.spare_servers (2) leaves no room to start another"
    )

    tight = loaded.model_copy(deep=True)
    tight.spec.rollout.spare_servers = 0
    refused = rollout_plan.plan(tight, new, old)
    assert not refused.feasible and "spare_servers is 0" in refused.steps[0].problem

    first = rollout_plan.plan(loaded, new, None)  # nothing live: all at once, no analysis to wait for
    assert [(s.fraction, s.new_servers, s.seconds) for s in first.steps] == [(1.0, 8, 600)]

    args = ["rollout-plan", str(PROD_SPEC), "--layout", "tp4-ep4-x2", "--rate-per-server", "18.1"]
    assert cli.main([*args, "--load-seconds", "600", "--live-rate-per-server", "12.5", "--live-layout", "tp8-ep8"]) == 0
    out = capsys.readouterr().out
    assert (
        "replacing live release (given) (tp8-ep8, 12.5 req/s per server)" in out
        and "expected duration: 95.0 min" in out
    )
    assert "   2     50%       6       4      13" in out
    spare0 = spec_file(PROD_SPEC, lambda d: d.setdefault("rollout", {}).update({"spare_servers": 0}), name="s0.yaml")
    assert cli.main(["rollout-plan", str(spare0), "--rate-per-server", "18.1", "--live-rate-per-server", "12.5"]) == 1
    assert "NOT FEASIBLE" in capsys.readouterr().out
    assert cli.main(["rollout-plan", str(PROD_SPEC)]) == 1  # neither a release nor a rate: one line, exit 1
    assert "give --release ID" in capsys.readouterr().err


def test_rollout_plan_of_a_registered_release_on_the_local_target(tmp_path, monkeypatch, capsys):
    from pipeline import cli
    from pipeline.release.registry import Registry

    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'r.db'}")
    reg = Registry()
    loaded = load_spec(TINY_SPEC)
    ids = []
    for run, rate, load in (("a", 40.0, [30.0]), ("b", 55.0, [28.0])):
        rel = reg.open_release(run, loaded.spec.name, str(TINY_SPEC), TINY_SPEC.read_text(), "local")
        reg.record(
            rel.id,
            detail_of("slo_gate", None),
            "gate",
            data=ReleaseData(chosen=chosen("single", rate_per_server=rate, load_seconds=load)),
        )
        ids.append(rel.id)
    reg.record(ids[0], detail_of("deploy_finished", None), "pipeline", status="live")
    assert cli.main(["rollout-plan", str(TINY_SPEC), "--release", str(ids[1])]) == 0
    out = capsys.readouterr().out
    assert f"rollout of release {ids[1]} (single, 55 req/s per server) on local, replacing live release {ids[0]}" in out
    assert "   1     50%       1       1       2" in out and "   2    100%       0       1       1" in out
    assert "expected duration: 40 s" in out  # one load (28 s) + two 6 s windows
    assert "nginx's weight split" in out


def test_a_restarted_prometheus_forgets_engines_that_are_gone(tmp_path):
    """Release ids repeat across registries, and a server stopped before a target was removed keeps
    its last `up`: a new server must not read a gone engine as a down engine of the new release."""
    root = tmp_path / "prometheus"
    url = local_prometheus.ensure(root)
    engine = FakeEngine(ttft=0.03, tpot=0.008)
    try:
        local_prometheus.scrape(root, 3, "single", [engine.port])
        local_prometheus.wait_scraped(url, 3, 1)
    finally:
        engine.stop()
        local_prometheus.stop(root)
    url = local_prometheus.ensure(root)
    try:
        assert analysis.query(url, 'count(up{release="3"})') is None
        assert not list((root / "targets").glob("*.json"))
    finally:
        local_prometheus.stop(root)


class FakeFleet:
    """The pods the fake API server says are ready, as exporters the real Prometheus scrapes.

    A thread follows the fake cluster's Deployments: each ready pod of a release gets a FakeEngine
    (registered under its release label, as the cluster's pod scrape would), and the client's
    `rate` req/s are shared by every ready pod, as the stable Service shares them. `slow` pods
    (release, pod index) answer at `slow_ttft`: a server of that release on a bad node."""

    def __init__(self, cluster, root, rate: float, slow: set[tuple[str, int]], slow_ttft: float):
        self.cluster, self.root, self.rate = cluster, root, rate
        self.slow, self.slow_ttft = slow, slow_ttft
        self.engines: dict[str, list[FakeEngine]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.stopping.wait(0.1):
            ready = {r: n for r, n in self.cluster.ready_pods().items() if r}
            for release in set(ready) | set(self.engines):
                engines = self.engines.setdefault(release, [])
                want = ready.get(release, 0)
                changed = len(engines) != want
                while len(engines) < want:
                    slow = (release, len(engines)) in self.slow
                    engines.append(FakeEngine(ttft=self.slow_ttft if slow else 0.4, tpot=0.02, rate=0))
                while len(engines) > want:
                    engines.pop().stop()
                if changed:
                    local_prometheus.scrape(self.root, int(release), "tp8-ep8", [e.port for e in engines])
            pods = sum(len(e) for e in self.engines.values())
            for engines in self.engines.values():
                for engine in engines:
                    engine.rate = self.rate / pods if pods else 0

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        for engines in self.engines.values():
            for engine in engines:
                engine.stop()


def test_kubernetes_rollout_of_a_3_server_fleet_judged_by_the_real_prometheus(prometheus, spec_file):
    """Through the official client against the fake API server: a 3-server fleet rollout that
    completes, then one whose second server is slow, aborted at its second step by the PromQL
    analysis, with the old release back on all three servers before the new one leaves."""
    from pipeline.k8s import manifests
    from pipeline.k8s.deploy import KubernetesTarget
    from pipeline.release import controller, promote, rollout_plan
    from tests.conftest import PROD_SPEC
    from tests.k8s_fake import FakeCluster

    root, url = prometheus

    def fast(d):  # the production spec, its windows shortened and its Prometheus the one started here
        d["rollout"].update(analysis_window="3s", scrape_interval="1s", min_requests=5, prometheus_url=url)

    loaded = load_spec(spec_file(PROD_SPEC, fast))
    # 144 req/s at peak + headroom: 3 servers at 60 req/s each, for the old and the new release
    plan = rollout_plan.plan(
        loaded, rollout_plan.Side(id=2, rate_per_server=60), rollout_plan.Side(id=1, rate_per_server=60)
    )
    assert [(s.old_servers, s.new_servers) for s in plan.steps] == [(3, 1), (2, 2), (0, 3)] and plan.feasible

    def render(release: str) -> list[dict]:
        artifact = manifests.Artifact(nfs_path=f"/mnt/models/r{release}", manifest_hash=release * 64)
        return manifests.render(loaded, "tp8-ep8", release, artifact, manifests.RenderOptions(servers=3))

    with FakeCluster() as cluster:
        fleet = FakeFleet(cluster, root, rate=60, slow={("3", 1)}, slow_ttft=9.0)  # SLO p90 TTFT 3000 ms
        target = KubernetesTarget(cluster.client(), poll_s=0.05, smoke_retry_delay_s=0.01)
        try:
            assert controller.rollout(target.release("1", render("1"), timeout_s=10)).status == "live"
            local_prometheus.wait_scraped(url, 1, 3)

            good = controller.rollout(
                target.release("2", render("2"), timeout_s=10),
                promote.server_steps(plan),
                promote.prometheus_judge(loaded, "2", "1"),
            )
            assert good.status == "live", good.error
            steps = [d for kind, d in good.events if kind == "rollout_step"]
            assert [(s["old_servers"], s["new_servers"], s["passed"]) for s in steps] == [
                (3, 1, True),
                (2, 2, True),
                (1, 3, True),  # the last step judged with the old release on the budget's spare server
            ]
            first = steps[0]["analysis"]
            assert not first["inconclusive"] and first["queries"]["new_requests"]["value"] >= 5
            assert first["queries"]["old_requests"]["value"] > first["queries"]["new_requests"]["value"]
            assert 0.2 < first["queries"]["new_p90_ttft"]["value"] <= 0.5  # the 0.4 s bucket, from Prometheus
            assert 'release="2"' in first["queries"]["new_p90_ttft"]["promql"]
            assert cluster.servers() == {"1": 0, "2": 3}  # release 1 at zero once the last analysis passed
            assert all(sum(h.values()) <= 4 for h in cluster.history)  # live fleet + 1 spare at most

            cluster.history.clear()
            bad = controller.rollout(
                target.release("3", render("3"), timeout_s=10),
                promote.server_steps(plan),
                promote.prometheus_judge(loaded, "3", "2"),
            )
            assert bad.status == "rolled_back"
            steps = [d for kind, d in bad.events if kind == "rollout_step"]
            assert [s["passed"] for s in steps] == [True, False]  # one good server passes; two, one slow, fail
            reasons = steps[1]["analysis"]["reasons"]
            assert any(r.startswith("p90 TTFT") and r.endswith("> SLO 3000 ms") for r in reasons), reasons
            assert steps[1]["analysis"]["queries"]["new_p90_ttft"]["value"] > 3
            assert "aborted at step 2 (2 new / 2 old servers)" in bad.error
            assert cluster.servers() == {"2": 3, "3": 0}
            assert all(h["2"] >= 2 for h in cluster.history)  # release 2 never below the step's share
        finally:
            fleet.stop()


def test_one_sizing_rule_for_the_new_fleet_never_below_what_keda_grew_the_live_one_to(spec_file, capsys):
    """`capacity`, `rollout-plan` and the ScaledObjects size the new fleet by one rule
    (capacity.fleet_servers: the peak with the spec's headroom at the measured rate, min_servers, and
    never fewer than the live fleet runs now), and the plan is checked against live + spare first."""
    from pipeline import cli
    from pipeline.k8s import autoscaler
    from pipeline.release import rollout_plan
    from pipeline.stages import capacity
    from tests.conftest import PROD_SPEC

    loaded = load_spec(PROD_SPEC)
    new = rollout_plan.Side(layout="tp4-ep4-x2", rate_per_server=18.1, load_seconds=600)
    old = rollout_plan.Side(layout="tp8-ep8", rate_per_server=12.5, load_seconds=540)
    cap = loaded.spec.capacity
    rule = capacity.fleet_servers(cap, 18.1)
    fleet = capacity.fleet("candidate", 18.1, cap, loaded.spec.workload, None)
    assert rule == fleet.servers == rollout_plan.plan(loaded, new, old).new_servers == 8
    auto = load_spec(
        spec_file(
            PROD_SPEC,
            lambda d: d["capacity"].update(max_servers=20, autoscale={"utilisation": 0.7}),
            name="auto.yaml",
        )
    )
    scaling = capacity.scaling(auto, 18.1, 600, "measured")
    assert scaling is not None and scaling.fallback_servers >= capacity.fleet_servers(auto.spec.capacity, 18.1)
    deployment = {"kind": "Deployment", "metadata": {"name": "qwen3-235b-a22b-fp8-r2-0", "namespace": "llm-serving"}}
    scaled = autoscaler.scaled_objects(auto, [deployment], 18.1)
    assert scaled[0]["spec"]["fallback"]["replicas"] == scaling.fallback_servers

    # KEDA grew the live fleet to 14 (the plan's 12 hold the peak): the new release gets 14, each step
    # holds its share of the 14 on both sides, and the budget is 14 + spare; with one spare server the
    # controller's own waves cannot get from 2 to 7 new ones, so it is refused before anything starts
    grown = rollout_plan.plan(loaded, new, old, live_running=14)
    assert (grown.live_servers, grown.new_servers, grown.live_running) == (14, 14, 14)
    assert [(s.old_servers, s.new_servers) for s in grown.steps] == [(13, 2), (7, 7), (0, 14)]
    assert not grown.feasible and "leaves no room to start another" in grown.steps[1].problem
    assert any("KEDA grew it above the 12 the peak needs" in n for n in grown.notes)
    roomy = loaded.model_copy(deep=True)
    roomy.spec.rollout.spare_servers = 2
    held = rollout_plan.plan(roomy, new, old, live_running=14)
    assert held.feasible and max(s.at_once for s in held.steps) <= 14 + 2
    assert sum(s.terminating for s in held.steps) == 14  # every old server drains out, counted until gone
    assert rollout_plan.plan(loaded, new, old, live_running=3).new_servers == 8  # a smaller one: the rule

    args = ["rollout-plan", str(PROD_SPEC), "--layout", "tp4-ep4-x2", "--rate-per-server", "18.1"]
    assert cli.main([*args, "--live-rate-per-server", "12.5", "--live-servers", "14"]) == 1
    out = capsys.readouterr().out
    assert "live fleet 14 servers (14 running now), the new one 14" in out and "NOT FEASIBLE" in out
