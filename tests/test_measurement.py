"""What a probe records beside the client's percentiles: CPU used by others (a real hog here),
and the engine's own histograms (vLLM's /metrics text, parsed as Prometheus would)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from pipeline.core.specs import SloSpec, WorkloadSpec
from pipeline.records.benchmark import BenchmarkFile, Probe
from pipeline.stages import affinity_guard, benchmark, engine_metrics, interference

HOG = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def test_a_real_cpu_hog_shows_as_other_and_is_named():
    quiet = interference.Window(engine_groups=set())
    time.sleep(1.0)
    calm = quiet.close()
    hog = subprocess.Popen([sys.executable, "-c", HOG, "cpu-hog"])
    try:
        time.sleep(0.3)
        window = interference.Window(engine_groups=set())
        time.sleep(1.5)
        seen = window.close()
    finally:
        hog.kill()
        hog.wait()
    assert seen.other >= 0.6 > calm.other + 0.3, (calm, seen)
    assert any("python" in name and cores >= 0.5 for name, cores in seen.top_other), seen.top_other
    assert seen.engine == 0 and seen.client == 0 and seen.wall_s >= 1.5


def test_the_engine_and_the_client_are_not_interference():
    if len(os.sched_getaffinity(0)) < 2:  # read now: an earlier test's isolation may have widened it
        pytest.skip("the busy engine and the client need a core each (this process is confined to one)")
    engine = subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True)  # a busy "engine" group
    try:
        time.sleep(0.3)
        window = interference.Window(engine_groups={engine.pid})
        client = subprocess.run(
            [sys.executable, "-c", "import time\nend = time.time() + 1\nwhile time.time() < end: pass"]
        )
        seen = window.close()
    finally:
        engine.kill()
        engine.wait()
    assert client.returncode == 0
    assert seen.engine >= 0.6 and seen.client >= 0.6, seen
    assert seen.other < 0.4, seen


def test_the_frontend_is_the_engine_group_less_vllms_engine_core_and_workers():
    """What the planner's host cost counts: the API server in an engine's group, not the processes
    vLLM retitles VLLM::EngineCore / VLLM::Worker (their titles are their command lines)."""
    api = subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True)
    core = subprocess.Popen(
        ["bash", "-c", f'exec -a VLLM::EngineCore {sys.executable} -c "{HOG}"'], start_new_session=True
    )
    try:
        before = interference.frontend_seconds({api.pid})
        time.sleep(1.0)
        api_s = interference.frontend_seconds({api.pid})
        both = interference.frontend_seconds({api.pid, core.pid})
        engine_core = interference.frontend_seconds({core.pid})
    finally:
        for proc in (api, core):
            proc.kill()
            proc.wait()
    assert 0.4 <= api_s - before <= 1.2, api_s - before  # one busy process over 1 s (beside the retitled one)
    assert engine_core == 0.0 and both == pytest.approx(api_s, abs=0.05)


def test_the_search_measures_again_beside_a_real_hog_and_keeps_the_clean_run():
    """A hog started beside the first steady probe: that probe is unclean, superseded, and
    measured again once the hog is gone; the search's answer rests on clean runs only."""
    slo = SloSpec(max_p90_ttft_ms=200, max_p90_tpot_ms=50, resolution=0.05)
    workload = WorkloadSpec(input_len=1, output_len=2, max_interference=0.3, interference_retries=2)
    mu = 60.0
    calls: list[float] = []

    def run(rate: float, n: int, seed: int) -> Probe:
        calls.append(rate)
        hog = subprocess.Popen([sys.executable, "-c", HOG]) if len(calls) == 2 else None
        try:
            window = interference.Window(engine_groups=set())
            time.sleep(0.8)
            seen = window.close()
        finally:
            if hog:
                hog.kill()
                hog.wait()
        p90 = math.log(10) / max(mu - rate, 1e-3) * 1000 if rate < mu else 1e6
        probe = Probe(
            rate=rate,
            num_prompts=n,
            achieved_rate=min(rate, mu),
            completed=n,
            failed=0,
            failed_fraction=0.0,
            duration_s=1,
            output_tok_s=0.0,
            p50_ttft_ms=p90 / 3,
            p90_ttft_ms=p90,
            p99_ttft_ms=p90,
            p50_tpot_ms=5,
            p90_tpot_ms=5,
            p99_tpot_ms=5,
            p90_itl_ms=5,
            p90_e2el_ms=p90,
            interference=seen,
        )
        benchmark.judge(probe, slo)
        return probe

    outcome = benchmark.slo_search(run, workload, slo, max_probes=20)
    first = [p for p in outcome.probes if p.rate == calls[1]]
    assert first[0].superseded and not first[0].clean and first[0].interference.other >= 0.5
    assert first[-1].clean and not first[-1].superseded
    assert outcome.unclean_rates == [] and outcome.max_slo_rate is not None


METRICS = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="model"} %(a)s
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="model"} %(b)s
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="model"} %(c)s
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="model"} %(c)s
vllm:time_to_first_token_seconds_count{engine="0",model_name="model"} %(c)s
vllm:time_to_first_token_seconds_sum{engine="0",model_name="model"} %(s)s
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="model"} %(c)s
vllm:request_queue_time_seconds_count{engine="0",model_name="model"} %(c)s
vllm:request_queue_time_seconds_sum{engine="0",model_name="model"} %(q)s
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="model"} %(c)s
vllm:e2e_request_latency_seconds_count{engine="0",model_name="model"} %(c)s
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="model"} %(s)s
"""


@pytest.fixture
def metrics_server():
    """A real HTTP server whose /metrics text changes between two scrapes."""
    from testkit import http_stub

    pages = [METRICS % dict(a=0, b=0, c=0, s=0, q=0), METRICS % dict(a=50, b=80, c=100, s=1.5, q=0.2)]

    def render() -> bytes:
        body = pages[0].encode()
        if len(pages) > 1:
            pages.pop(0)
        return body

    server = http_stub.serve(render)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_engine_view_is_the_difference_of_two_scrapes(metrics_server):
    before = engine_metrics.scrape(metrics_server)
    after = engine_metrics.scrape(metrics_server)
    view = engine_metrics.view(before, after)
    # 100 requests: 50 under 10 ms, 30 in 10-20 ms, 20 in 20-40 ms; rank 90 lies half way into the last bucket
    assert view.requests == 100
    assert view.p90_ttft_ms == pytest.approx(30.0)
    assert view.mean_queue_ms == pytest.approx(2.0) and view.mean_e2e_ms == pytest.approx(15.0)
    assert view.mean_prefill_ms is None  # not exposed by this page: absent, not zero


def test_replicas_merge_and_an_unreachable_endpoint_is_not_fatal():
    snap = {"ttft": ({0.01: 5.0, math.inf: 10.0}, 0.1, 10.0)}
    merged = engine_metrics.merge([snap, snap])
    assert merged["ttft"] == ({0.01: 10.0, math.inf: 20.0}, 0.2, 20.0)
    assert engine_metrics.scrape("http://127.0.0.1:9", timeout=1) == {}
    assert engine_metrics.quantile({0.01: 0.0, 0.02: 10.0, math.inf: 10.0}, 0.5) == pytest.approx(0.015)


def test_the_bench_client_reads_events_split_after_the_field_name():
    """Behind nginx a network chunk can end right after `data:`; vLLM's client strips each chunk
    and then cannot parse the event (a failed request). vllm_cli.py reads `data:` as SSE defines it."""
    from pipeline.stages import serving

    code = (
        "import runpy\n"
        f"g = runpy.run_path({str(serving.VLLM_CLI)!r}, run_name='check')\n"
        "from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler as H\n"
        "chunks = [b'data: {\"a\": 1}\\n\\ndata:', b' {\"b\": 2}\\n\\n', b'data: {\"c\": 3}\\n\\ndata: [DONE]\\n\\n']\n"
        "for fixed in (False, True):\n"
        "    if fixed: g['_sse_events_as_specified']()\n"
        "    h = H(); out = []\n"
        "    for c in chunks: out += h.add_chunk(c.strip())\n"
        "    print(out)\n"
    )
    proc = subprocess.run([str(serving.SERVE_PYTHON), "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    unfixed, fixed = proc.stdout.strip().splitlines()[-2:]
    assert "data:{" in unfixed  # the upstream behaviour this works around
    assert fixed == "['data: {\"a\": 1}', 'data: {\"b\": 2}', 'data: {\"c\": 3}', 'data: [DONE]']"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="isolation needs a second core")
def test_isolation_keeps_every_other_process_off_the_engine_cores_and_gives_them_back():
    from pipeline.stages import serving

    cores = serving.all_cores()
    if os.sched_getaffinity(0) != set(cores):  # `taskset -c 0 make test`: children start confined
        pytest.skip("this process is confined to some of the machine's cores: its children would start there")
    service = serving.project_cores()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # someone else's process in its own class: the isolation moves it to SCHED_IDLE and gives SCHED_BATCH
    # back (as root; not a child of ours: the search's own children keep theirs)
    orphan = "import os, time; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); time.sleep(60)"
    batch = int(
        subprocess.run(
            ["sh", "-c", f"{sys.executable} -c '{orphan}' >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
        ).stdout
    )
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    # another session (Airflow's, say; not ours: the search's own children in sessions of their own, the load
    # client's, keep theirs): the idle class does not cross autogroups, so its group's nice goes to 19
    session = int(
        subprocess.run(
            ["sh", "-c", f"setsid {sys.executable} -c 'import time; time.sleep(60)' >/dev/null 2>&1 & echo $!"],
            capture_output=True,
            text=True,
        ).stdout
    )
    policy = os.sched_getscheduler
    root = os.geteuid() == 0
    try:
        time.sleep(0.3)
        group = affinity_guard.autogroup(session)  # None where the kernel has no autogroups
        engine_group = affinity_guard.autogroup(engine.pid)
        before = os.sched_getaffinity(bystander.pid)
        own = policy(0)
        with serving.isolated([engine.pid], service) as iso:
            assert sorted(os.sched_getaffinity(bystander.pid)) == service
            assert sorted(os.sched_getaffinity(0)) == service  # the search's own process too
            assert os.sched_getaffinity(engine.pid) == set(cores)  # an engine's group is left alone
            assert bystander.pid in iso.moved
            born = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            assert sorted(os.sched_getaffinity(born.pid)) == service
            guardian, state = iso.guardian, iso.state_file
            assert guardian and guardian.poll() is None and state and state.exists()  # written before any change
            # the search's own process and its children keep their priority; the engine too; others yield
            assert policy(0) == own and policy(bystander.pid) == own and policy(engine.pid) == own
            assert policy(batch) == (os.SCHED_IDLE if root else os.SCHED_BATCH)
            if group:
                assert affinity_guard.autogroup(session) == (group[0], 19 if root else group[1])
                assert affinity_guard.autogroup(engine.pid) == engine_group  # an engine's session keeps its nice
        assert os.sched_getaffinity(bystander.pid) == before
        assert os.sched_getaffinity(0) == set(cores)
        assert os.sched_getaffinity(born.pid) == set(cores)  # born confined: gets its parent's mask back
        assert policy(batch) == os.SCHED_BATCH and policy(0) == own
        assert affinity_guard.autogroup(session) == group
        assert guardian.poll() == 0 and not state.exists()  # told to leave, nothing for it to restore
    finally:
        os.kill(batch, 9)
        os.kill(session, 9)
        for proc in (bystander, engine, locals().get("born")):
            if proc:
                proc.kill()
                proc.wait()


PROXY_CHECK = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
import aiohttp, vllm_cli
vllm_cli._proxy_lookup_once(["bench", "serve", "--base-url", "http://127.0.0.1:8000"])
async def main():
    async with aiohttp.ClientSession(trust_env=True) as session:  # as vLLM's bench serve opens it
        print(json.dumps(session.trust_env))
asyncio.run(main())
"""


@pytest.mark.parametrize(
    "env, looks_up",
    [
        ({}, False),
        ({"HTTP_PROXY": "http://10.0.0.1:3128"}, True),
        ({"HTTP_PROXY": "http://10.0.0.1:3128", "NO_PROXY": "127.0.0.1"}, False),
    ],
    ids=["no-proxy", "a-proxy-for-the-target", "target-bypassed"],
)
def test_the_bench_client_looks_proxies_up_per_request_only_where_one_applies(env, looks_up):
    """vllm_cli.py opens vLLM's bench session without aiohttp's per-request proxy and netrc lookups
    (~0.3 ms a request on the core the API server shares) when no proxy in the environment applies
    to the target; a proxy that applies is still used (the session keeps trust_env)."""
    from pipeline.stages import serving

    clean = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    out = subprocess.run(
        [str(serving.SERVE_PYTHON), "-c", PROXY_CHECK, str(serving.VLLM_CLI.parent)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == ("true" if looks_up else "false")


def test_the_bench_client_forks_a_fresh_client_per_probe_and_reports_its_cpu(tmp_path):
    """vllm_cli.py bench-server: vLLM imported once; each run a new process whose exit code,
    output and CPU seconds come back; closing it leaves no process behind."""
    import os

    from pipeline.stages import serving

    client = benchmark.BenchClient([str(serving.SERVE_PYTHON), str(serving.VLLM_CLI)], dict(os.environ))
    try:
        client.ensure()
        server = client.group
        window = interference.Window(engine_groups=set(), client_group=server)
        code, cpu = client.run(["bench", "serve", "--help"], tmp_path / "help.log")
        seen = window.close(cpu)
        assert code == 0 and "usage: vllm bench serve" in (tmp_path / "help.log").read_text()
        assert cpu > 0 and seen.client >= cpu / seen.wall_s * 0.9
        code, _ = client.run(["bench", "serve", "--no-such-flag"], tmp_path / "bad.log")
        assert code != 0 and "no-such-flag" in (tmp_path / "bad.log").read_text()
        assert client.group == server  # the same server answered both: the import was paid once
    finally:
        client.close()
    assert client.group is None
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


def test_cpu_work_injected_in_the_client_makes_its_probes_client_bound_and_the_report_says_so(tmp_path):
    """#44 item 1's signal: the independent client (benchmarks/open_loop_client.py) against the M/M/1
    stand-in server, as it is (~1 ms CPU a request here) at the prior, 100 req/s, then above it with
    8 ms of CPU spent in its event loop per streamed chunk. The heavy client sends late against its
    Poisson schedule (its per-request lag, recorded under vLLM's `queue_times` key), so that probe is
    client-bound and the light one is not. The heavy probe decides the answer (the fail capping it, or
    its only pass), so the result is marked, and the report's layout row, probe table and note say so.
    ~8 s on a quiet machine (a server, two 0.8 s probes and their drain), 20 s at a load of 15."""
    import socket

    from pipeline.core.specs import load_spec
    from pipeline.release import report
    from tests.conftest import TINY_SPEC
    from tests.test_benchmark import layout_result

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            os.path.join(root, "testkit", "simserver.py"),
            "--port",
            str(port),
            "--mu",
            "400",
            "--tpot-ms",
            "2",
        ]
    )
    # a generous SLO (a loaded machine slows the stand-in server too) and a limit of 5% of it: 100 ms
    slo = SloSpec(max_p90_ttft_ms=2000, max_p90_tpot_ms=200, resolution=0.05)
    workload = WorkloadSpec(
        input_len=16, output_len=8, num_prompts=10, min_probe_seconds=0.8, repeats=0, max_client_lag=0.05
    )
    burns: list[float] = []

    def run(rate: float, n: int, seed: int) -> Probe:
        burn = 8.0 if rate > 100.0 else 0.0  # light at the prior, CPU work injected above it
        burns.append(burn)
        out = tmp_path / f"probe-{len(burns)}.json"
        subprocess.run(
            [sys.executable, os.path.join(root, "benchmarks", "open_loop_client.py"), "--url", f"http://127.0.0.1:{port}",
             "--rate", str(rate), "--seconds", str(n / rate), "--input-len", "16", "--output-len", "8",
             "--seed", str(seed), "--burn-ms", str(burn), "--out", str(out)],
            check=True, timeout=120, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return benchmark.parse_result(out, rate, n, slo, workload)

    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and server.poll() is None, "the stand-in server did not start"
            time.sleep(0.1)
        outcome = benchmark.slo_search(run, workload, slo, max_probes=2, prior=100.0)
    finally:
        server.kill()
        server.wait()
    light, heavy = [p for p in outcome.probes if not p.superseded]  # (a light run may be repeated, inconclusive)
    assert burns[0] == 0.0 and burns[-1] == 8.0 and light.rate == 100.0 and heavy.rate > light.rate
    limit = workload.max_client_lag * slo.max_p90_ttft_ms
    assert not light.client_bound and light.client_lag_p90_ms is not None and light.client_lag_p90_ms <= limit
    # client-bound by the measured signal: its p90 send lag or its last send's lag past the limit (which one
    # trips first depends on the machine: a CI run read p90 99.3 ms, last send 165 ms, limit 100 ms)
    lags = [lag for lag in (heavy.client_lag_p90_ms, heavy.client_lag_end_ms) if lag is not None]
    assert heavy.client_bound and max(lags) > limit, (heavy.client_lag_p90_ms, heavy.client_lag_end_ms)
    assert heavy.client_note.startswith("client-bound: ") and "limit 100 ms" in heavy.client_note
    assert heavy.client_cpu_ms_per_request > light.client_cpu_ms_per_request  # the injected work, measured
    # the heavy probe decides the answer (the fail above it, or as its only pass when it held): the result is marked
    assert outcome.client_bound and outcome.client_bound_rates == [heavy.rate]
    assert f"client-bound at {heavy.rate:.3g} req/s (deciding the answer" in outcome.stop_reason
    result = layout_result(outcome)
    bench = BenchmarkFile(layouts=[result])
    from pipeline.release.registry import NOTHING_CHOSEN

    row = report._section_performance(bench, NOTHING_CHOSEN, None, load_spec(TINY_SPEC), None)
    assert f"{outcome.max_slo_rate:.3g} (client-bound)</td>" in row
    quality = report._section_measurement(bench)
    assert quality.count("(client-bound)</td>") == 1  # the heavy probe's verdict, not the light one's
    assert (
        f"single: the load client was client-bound at {heavy.rate:.3g} req/s (the runs deciding the answer" in quality
    )


@pytest.mark.parametrize("rate", [0.5, 5.0, 500.0])
def test_a_client_on_schedule_is_not_client_bound_at_any_rate_and_one_late_at_the_end_is(rate):
    """The lag signal on vLLM's own result keys, without a client: sends exactly on a Poisson schedule
    scaled to end n / rate after its start (as vLLM's is) read no lag, even at 0.5 req/s where the
    first send's wait alone is seconds; the same sends with the last fifth late by 100 ms more than that
    first wait (the end lag reads a lag less the first wait: a lower bound) read client-bound by the end
    lag, with the loop's queue times still at zero (the 50 ms limit of a 500 ms SLO). ~0.01 s."""
    import random

    rng = random.Random(3)
    n, t, due = 200, 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        due.append(t)
    due = [d * n / rate / due[-1] for d in due]
    slo, workload = SloSpec(max_p90_ttft_ms=500, max_p90_tpot_ms=50), WorkloadSpec(input_len=1, output_len=2)
    late = [d + (0.1 + due[0] if i >= 0.8 * n else 0.0) for i, d in enumerate(due)]
    for starts, bound in ((due, False), (late, True)):
        probe = Probe(
            rate=rate, num_prompts=n, achieved_rate=rate, completed=n, failed=0, failed_fraction=0.0,
            duration_s=n / rate, output_tok_s=0.0, p50_ttft_ms=1, p90_ttft_ms=1, p99_ttft_ms=1, p50_tpot_ms=1,
            p90_tpot_ms=1, p99_tpot_ms=1, p90_itl_ms=1, p90_e2el_ms=1,
        )  # fmt: skip
        probe.client_lag_p90_ms, probe.client_lag_end_ms = benchmark.client_lag_ms(
            {"start_times": [1000.0 + s for s in starts], "queue_times": [0.0] * n}, rate
        )
        benchmark.mark_client_bound(probe, slo, workload)
        assert probe.client_lag_p90_ms == 0.0 and probe.client_bound is bound, (rate, probe.client_lag_end_ms)
        if bound:
            assert 50 < probe.client_lag_end_ms <= 100 and "last send" in probe.client_note
