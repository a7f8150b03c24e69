"""Stopping an engine without cutting a stream: wait until its own `/metrics` shows no request.

One wait for both targets. The local target runs it after the nginx front no longer sends the
engine anything, before it signals the engine; on Kubernetes the same file is the vLLM
container's `preStop` hook (`python3 -c`, the engine image's own interpreter and its own
prometheus-client, which vLLM depends on; the image has no curl we can count on), which the
kubelet runs before it sends SIGTERM. Why: the production image's vLLM (0.11.2) aborts every
request in flight on SIGTERM (`--shutdown-timeout`, vLLM's own drain, exists from 0.18), so a
server scaled away mid-answer fails each stream it held.

The wait is bounded by the route's request timeout: a request running longer is cut by the
Gateway (the front's `proxy_read_timeout`) anyway. This module imports nothing of the project.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.request

# the route's request timeout (Gateway API HTTPRoute `timeouts.request`, the local front's
# proxy_read_timeout): the longest a request is let run, so the longest a drain waits
REQUEST_TIMEOUT_S = 600
# on Kubernetes, how long a terminating pod may still be sent new requests: its endpoint leaves
# the Service's EndpointSlice, then every data plane (Cilium's per-node Envoy) drops it. The
# preStop waits this long before it trusts an idle engine (the vLLM guide's and KServe's 15 s).
ENDPOINT_LAG_S = 15
# vLLM's own drain on SIGTERM where the image has `--shutdown-timeout` (vLLM >= 0.18): for what
# arrived after the preStop saw the engine idle
SHUTDOWN_TIMEOUT_S = 30
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def in_flight(url: str, timeout: float = 5) -> float | None:
    """Requests the engine at `url` runs or queues (vLLM's gauges); None if /metrics is unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
            text = response.read().decode()
    except OSError:
        return None
    return sum(s.value for f in text_string_to_metric_families(text) if f.name in GAUGES for s in f.samples)


def wait_idle(
    url: str, bound_s: float, lag_s: float = 0.0, poll_s: float = 0.5, unreadable_s: float = 10.0
) -> dict[str, float | None]:
    """Wait, at most `bound_s` after `lag_s`, until the engine runs and queues no request, or its
    /metrics has not answered for `unreadable_s` (a busy engine may miss a read; one that stays
    silent is gone: nothing left to wait for). Idle takes two reads of 0 in a row: vLLM's gauges
    once read 0 with 16 requests running (the next read, milliseconds later, 16). Returns what it
    saw: the most requests in flight (None: silent from the start, then nothing is waited for),
    seconds waited, requests left when it stopped waiting (0: drained)."""
    started = time.monotonic()
    first = in_flight(url)
    while first is None and time.monotonic() - started < unreadable_s:
        time.sleep(poll_s)
        first = in_flight(url)
    if first is None:
        return {"in_flight": None, "seconds": round(time.monotonic() - started, 1), "left": None}
    if lag_s > 0:
        time.sleep(lag_s)
    deadline = time.monotonic() + bound_s
    most, left, zeros = first, in_flight(url), 0
    silent_since = None if left is not None else time.monotonic()
    while time.monotonic() < deadline:
        zeros = zeros + 1 if left == 0 else 0
        if zeros == 2 or (silent_since is not None and time.monotonic() - silent_since >= unreadable_s):
            break
        time.sleep(poll_s)
        left = in_flight(url)
        if left is None:
            silent_since = silent_since or time.monotonic()
        else:
            silent_since, most = None, max(most, left)
    return {"in_flight": max(most, left or 0), "seconds": round(time.monotonic() - started, 1), "left": left}


def image_vllm_version(image: str) -> tuple[int, int] | None:
    """The vLLM (major, minor) an engine image's reference names: `rocm/vllm:rocm7.0.0_vllm_0.11.2_...`,
    `model-release/vllm-cpu:0.32.0`, `vllm/vllm-openai:v0.18.0`; None where it does not say (an
    image pinned by digest alone)."""
    reference = image.split("@", 1)[0]
    name, _, tag = reference.rpartition(":") if ":" in reference.rsplit("/", 1)[-1] else (reference, "", "")
    named = re.search(r"vllm[_-]v?(\d+)\.(\d+)", tag)
    if named is None and "vllm" in name.rsplit("/", 1)[-1]:
        named = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?", tag)
    return (int(named[1]), int(named[2])) if named else None


def shutdown_flags(image: str, engine_args: dict) -> list[str]:
    """`--shutdown-timeout` for an engine of `image` where its vLLM has the flag (>= 0.18) and the
    spec's engine args do not set it: vLLM then finishes what is in flight on SIGTERM. Elsewhere
    nothing (0.11.2 would refuse the flag): the preStop's wait is the whole drain there."""
    version = image_vllm_version(image)
    if "shutdown-timeout" in engine_args or version is None or version < (0, 18):
        return []
    return ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


def main(argv: list[str]) -> int:
    """preStop: `python3 -c <this file> PORT BOUND_S LAG_S`; always exits 0 (a failed hook only
    delays the kill by the grace period, and says nothing the engine's log does not)."""
    port, bound_s, lag_s = int(argv[0]), float(argv[1]), float(argv[2])
    seen = wait_idle(f"http://127.0.0.1:{port}", bound_s, lag_s)
    print(f"preStop drain: {seen}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
