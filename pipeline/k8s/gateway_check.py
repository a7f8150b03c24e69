"""The data-plane checks of a release: reach its Service through the API server's proxy, find the
Gateway's address, ask the release by its own rule (the release header), and wait until the
Gateway serves the route's weights.

What `pipeline.k8s.deploy.KubernetesRelease.check` and `route` call; nothing here writes to the
cluster.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pipeline.core.errors import KubernetesError, ReleaseError, RolloutFailed, SmokeFailed
from pipeline.k8s.kubeapi import _call
from pipeline.k8s.manifests import RELEASE_HEADER, WEIGHTS_HEADER, weights_tag
from pipeline.records.evaluate import Endpoint
from pipeline.records.rollout import GatewaySmoke

log = logging.getLogger(__name__)


def service_endpoint(api, namespace: str, service: str, port: int) -> Endpoint:
    """A Service's engine as lm-eval reaches it: through the API server's service proxy, with the
    client's own credentials (its bearer token, refreshed as the client refreshes it) and CA, so
    the check needs no route into the cluster network, like the smoke test."""
    configuration = api.configuration
    headers = {
        auth["key"].title() if auth["key"].lower() == "authorization" else auth["key"]: auth["value"]
        for auth in configuration.auth_settings().values()
        if auth.get("in") == "header" and auth.get("value")
    }
    return Endpoint(
        url=f"{configuration.host.rstrip('/')}/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy",
        headers=headers,
        ca_cert=configuration.ssl_ca_cert,
        verify=bool(configuration.verify_ssl),
    )


GATEWAY_API = "gateway.networking.k8s.io/v1"
RETRIED = {404, 502, 503, 504}  # the Gateway has no rule or no ready endpoint for the request yet


def gateway_url(api, route: dict) -> tuple[str, str]:
    """(Gateway namespace/name, its URL) for the route's first parent: the first address in the
    Gateway's status (what its controller programmed: the load balancer users reach) and the port of
    the listener the route attaches to (its sectionName, else the first HTTP or HTTPS one). From an
    Airflow worker in the cluster this is the path a client takes; reading it needs `get` on
    gateways only."""
    parent = route["spec"]["parentRefs"][0]
    name = f"{parent.get('namespace') or route['metadata']['namespace']}/{parent['name']}"
    namespace, gateway_name = name.split("/")
    try:
        gateway = _call(api, "GET", f"/apis/{GATEWAY_API}/namespaces/{namespace}/gateways/{gateway_name}")
    except KubernetesError as exc:
        if exc.status != 404:
            raise
        raise SmokeFailed(f"Gateway {name}: not found (promotion.gateway names it); create it first") from None
    status = gateway.get("status") or {}
    addresses = [a["value"] for a in status.get("addresses") or [] if a.get("value")]
    if not addresses:
        conditions = ", ".join(f"{c.get('type')}={c.get('status')}" for c in status.get("conditions", [])) or "none"
        raise SmokeFailed(f"Gateway {name}: no address in its status (not programmed yet? conditions: {conditions})")
    section = parent.get("sectionName")
    listeners = gateway.get("spec", {}).get("listeners", [])
    listener = next(
        (
            item
            for item in listeners
            if (item.get("name") == section if section else item.get("protocol") in ("HTTP", "HTTPS"))
        ),
        None,
    )
    if listener is None:
        raise SmokeFailed(f"Gateway {name}: no {'listener ' + section if section else 'HTTP or HTTPS listener'}")
    host = addresses[0]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    scheme = "https" if listener.get("protocol") == "HTTPS" else "http"
    return name, f"{scheme}://{host}:{listener['port']}"


def named_smoke(
    api,
    manifests: list[dict],
    timeout_s: float = 120.0,
    deadline_s: float = 60.0,
    retry_delay_s: float = 2.0,
) -> GatewaySmoke:
    """One short completion through the model's Gateway, as a client sends it, naming the release's
    Service in RELEASE_HEADER: it passes only when the answer carries that header back (the Gateway
    served the release's own rule, whose one backend selects only its pods) with a completion.
    An answer from elsewhere (no header: the default rule; another release's; a 404 or 5xx of the
    Gateway, or no connection) means the Gateway's data plane does not serve the rule yet, though the
    route's status may say Accepted: asked again until `deadline_s`. A wrong answer of the release
    itself (an error, no choices) fails at once."""
    import requests

    namespace, service, _, model = _smoke_target(manifests)
    route = _route_of(manifests)
    gateway, base = gateway_url(api, route)
    where = f"smoke test through Gateway {gateway} ({base}, HTTPRoute {namespace}/{route['metadata']['name']})"
    body: dict[str, Any] = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    wrong: list[str] = []
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            response = requests.post(
                f"{base}/v1/completions",
                json=body,
                headers={RELEASE_HEADER: service},
                timeout=(min(10.0, timeout_s), timeout_s),  # an address not reachable from here fails fast
            )
        except requests.RequestException as exc:
            answered, status, answer = f"no answer ({type(exc).__name__})", None, {}
        else:
            status, answered = response.status_code, response.headers.get(RELEASE_HEADER, "")
            try:
                answer = response.json()
            except ValueError:
                answer = {"text": response.text[:300]}
        if status is not None and answered == service and status not in RETRIED - {404}:
            choices = (answer.get("choices") or []) if status == 200 else []
            if not choices:
                raise SmokeFailed(
                    f"{where}: release {service} answered HTTP {status}, expected a completion: "
                    + json.dumps(answer)[:300]
                )
            return GatewaySmoke(
                gateway=gateway,
                url=base,
                release=service,
                answered_by=answered,
                tries=len(wrong) + 1,
                wrong=wrong,
                text=str(choices[0].get("text", "")),
            )
        if status is not None:  # another release's rule, or none of a release (the default rule, no rule)
            answered = f"HTTP {status} " + (f"from {answered}" if answered else f"without {RELEASE_HEADER}")
        wrong.append(answered)
        if time.monotonic() > deadline:
            raise SmokeFailed(
                f"{where}: no answer from release {service} in {len(wrong)} tries over {deadline_s:g} s; "
                f"the last: {wrong[-1]} (does the Gateway serve the route's rule for {RELEASE_HEADER}: {service}?)"
            )
        time.sleep(retry_delay_s)


def gateway_serves(
    api,
    route: dict,
    weights: dict[str, int],
    deadline_s: float = 60.0,
    retry_delay_s: float = 2.0,
    confirmations: int = 3,
) -> int:
    """Wait until the Gateway's data plane serves the route's default rule with `weights`: a route's
    status may say Accepted while its proxies still route by the previous rules (they are
    reconfigured after the controller accepted the change), and a step judged then would judge
    traffic the new release never got. Asks the Gateway's address as a client does (GET /v1/models,
    which every engine answers and no request metric counts) until `confirmations` answers in a row
    carry the rule's WEIGHTS_HEADER for these weights (one answer proves only the proxy that routed
    it). RolloutFailed past `deadline_s`; returns the requests it took."""
    import requests

    gateway, base = gateway_url(api, route)
    want = weights_tag(weights)
    seen: list[str] = []
    in_a_row = 0
    deadline = time.monotonic() + deadline_s
    while in_a_row < confirmations:
        try:
            response = requests.get(f"{base}/v1/models", timeout=(10.0, 30.0))
            served = response.headers.get(WEIGHTS_HEADER) or f"HTTP {response.status_code} without {WEIGHTS_HEADER}"
        except requests.RequestException as exc:
            served = f"no answer ({type(exc).__name__})"
        seen.append(served)
        in_a_row = in_a_row + 1 if served == want else 0
        if in_a_row < confirmations and time.monotonic() > deadline:
            meta = route["metadata"]
            raise RolloutFailed(
                f"HTTPRoute {meta['namespace']}/{meta['name']}: accepted, but Gateway {gateway} ({base}) did not "
                f"serve its weights {want} within {deadline_s:g} s ({len(seen)} requests, the last answered "
                f"{seen[-1]}): its data plane has not taken the change, so no traffic moved"
            )
        if served != want:
            time.sleep(retry_delay_s)
    log.info("Gateway %s serves %s (after %d requests)", gateway, want, len(seen))
    return len(seen)


def _engine_argv(deployment: dict) -> list[str]:
    """The engine command a rendered Deployment's pods run."""
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def _smoke_target(manifests: list[dict]) -> tuple[str, str, int, str]:
    """(namespace, service, port, served model name) from the rendered objects."""
    service = next((obj for obj in manifests if obj["kind"] == "Service"), None)
    deployment = next((obj for obj in manifests if obj["kind"] == "Deployment"), None)
    if service is None or deployment is None:
        raise ReleaseError(
            "manifests: expected at least one Deployment and a Service (see pipeline.k8s.manifests.render)"
        )
    argv = _engine_argv(deployment)
    model = argv[argv.index("--served-model-name") + 1]
    meta = service["metadata"]
    return meta["namespace"], meta["name"], int(service["spec"]["ports"][0]["port"]), model


def _route_of(manifests: list[dict]) -> dict:
    route = next((obj for obj in manifests if obj["kind"] == "HTTPRoute"), None)
    if route is None:
        raise ReleaseError(
            "manifests: no HTTPRoute (the model's address on the Gateway): render them again with promotion.gateway set"
        )
    return route
