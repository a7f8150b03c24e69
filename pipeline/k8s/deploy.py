"""Roll a release out to a cluster with the official `kubernetes` client, in steps, beside the live one.

Objects go in by server-side apply (what `kubectl apply --server-side` sends): the API server
merges our fields, records `model-release` as their manager, and an apply of the same objects
twice changes nothing; replicas change through the scale subresource (what `kubectl scale`
sends). Requests are made with the client's `call_api` on the objects' REST paths rather than
through `DynamicClient`, which needs API discovery first and adds nothing for the kinds a
release has; authentication and TLS stay the client's.

This module only acts: `KubernetesRelease` is one release's rollout primitives (its state, start
N servers unexposed, check them through the Gateway by the release's own rule, scale, set the
HTTPRoute's weights, take a failed release down).
What to do when (waves, steps, aborts, the keep window, recovery) is decided by the controller
both targets run, `pipeline.release.controller`.

The requests, listing and the wait for a rollout are `pipeline.k8s.kubeapi`; the data-plane
checks (Service proxy, Gateway, smoke) `pipeline.k8s.gateway_check`. Every write (apply, scale,
delete, the route's and the scalers' patches) is made here, through this module's `_call`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from pipeline.core.errors import AnswersWorse, KubernetesError, RolloutFailed
from pipeline.core.rollout import WEIGHT_TOTAL, Event, Fleet, RolloutRecord
from pipeline.k8s import autoscaler
from pipeline.k8s.gateway_check import (
    _engine_argv,
    _route_of,
    _smoke_target,
    gateway_serves,
    named_smoke,
    service_endpoint,
)
from pipeline.k8s.kubeapi import (
    APPLY_PATCH,
    FIELD_MANAGER,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    MERGE_PATCH,
    _call,
    _describe,
    api_client,
    listing,
    object_path,
    wait_rollout,
)
from pipeline.k8s.manifests import RELEASE_LABEL, TOKENIZER_INFO_FLAG, named_releases, route_weights, with_backends
from pipeline.records import events as ev
from pipeline.stages.served_accuracy import Answers

log = logging.getLogger(__name__)

ROLLOUT_ANNOTATION = "model-release/rollout"

# ---------------------------------------------------------------- apply, scale, delete


def apply(
    api,
    objs: list[dict],
    field_manager: str = FIELD_MANAGER,
    timeout_s: float = 3600.0,
    poll_s: float = 5.0,
    wait: bool = True,
) -> list[dict]:
    """Server-side apply every object in order, then (`wait`) wait until each Deployment has rolled
    out. Returns the objects as the server holds them after the apply."""
    applied = []
    for obj in objs:
        applied.append(
            _call(
                api,
                "PATCH",
                object_path(obj),
                body=obj,
                content_type=APPLY_PATCH,
                query={"fieldManager": field_manager, "force": "true"},
            )
        )
        log.info("applied %s", _describe(obj))
    if wait:
        wait_rollout(api, [obj for obj in objs if obj["kind"] == "Deployment"], timeout_s, poll_s)
    return applied


def scale(api, deployment: dict, replicas: int) -> None:
    """What `kubectl scale` sends: a merge patch of the Deployment's scale subresource."""
    _call(
        api,
        "PATCH",
        object_path(deployment) + "/scale",
        body={"spec": {"replicas": replicas}},
        content_type=MERGE_PATCH,
    )
    deployment.setdefault("spec", {})["replicas"] = replicas


def delete(api, obj: dict) -> None:
    _call(api, "DELETE", object_path(obj), query={"propagationPolicy": "Background"})
    log.info("deleted %s", _describe(obj))


def _progress_deadline(manifests: list[dict]) -> float:
    deadlines = [obj["spec"].get("progressDeadlineSeconds", 600) for obj in manifests if obj["kind"] == "Deployment"]
    return float(max(deadlines, default=600) + 60)


# ---------------------------------------------------------------- the progressive rollout


def _own_service(manifests: list[dict]) -> str:
    """The release's own Service (it selects the release's pods only)."""
    return next(
        o["metadata"]["name"]
        for o in manifests
        if o["kind"] == "Service" and RELEASE_LABEL in o["spec"].get("selector", {})
    )


def _release_of(obj: dict) -> str:
    return (obj["metadata"].get("labels") or {}).get(RELEASE_LABEL, "")


class KubernetesTarget:
    """A cluster the controller (`pipeline.release.controller`) rolls releases out to: the API
    client and how patiently it is polled. `release` binds it to one release's rendered objects."""

    def __init__(
        self,
        api,
        field_manager: str = FIELD_MANAGER,
        poll_s: float = 5.0,
        smoke_timeout_s: float = 120.0,
        smoke_retry_delay_s: float = 2.0,
        route_timeout_s: float = 60.0,
        route_confirmations: int = 3,
    ):
        self.api = api
        self.field_manager = field_manager
        self.poll_s = poll_s
        self.smoke_timeout_s = smoke_timeout_s
        self.smoke_retry_delay_s = smoke_retry_delay_s
        self.route_timeout_s = route_timeout_s  # for the Gateway to accept a route, and then to serve it
        self.route_confirmations = route_confirmations  # answers in a row that show the data plane serves it

    @classmethod
    def from_connection(cls, conn_id: str | None = None, **kwargs: Any) -> KubernetesTarget:
        return cls(api_client(conn_id), **kwargs)

    def check_reachable(self) -> str:
        """The server's version; ClusterUnreachable when it does not answer."""
        version = _call(self.api, "GET", "/version", timeout_s=15).get("gitVersion", "?")
        log.info("Kubernetes API %s answers (version %s)", self.api.configuration.host, version)
        return version

    def release(
        self,
        release_id: str,
        manifests: list[dict],
        answers: Answers | None = None,
        timeout_s: float | None = None,
    ) -> KubernetesRelease:
        """The rollout primitives for one release's rendered objects; ClusterUnreachable before
        anything changes when the API server does not answer."""
        self.check_reachable()
        return KubernetesRelease(self, release_id, manifests, answers, timeout_s)


class KubernetesRelease:
    """One release's rollout primitives on a cluster (the controller's Target).

    Traffic reaches a release only through the model's HTTPRoute, whose default rule's backends are
    the releases' own Services with the weights the controller sets: the new release's pods start
    unexposed (Ready in their own Service, with no share), the route gets a rule of the release's
    own (matched by RELEASE_HEADER) through which each step's smoke test goes, by the Gateway's
    address, its served answers go through its Service, and only then does the default rule give it
    a share. A release that failed leaves the route (weight and rule) and goes to zero servers.
    A server is one pod per replica group (each group its own Deployment). Objects go in by
    server-side apply; replicas change through the scale subresource. The rollout's record is an
    annotation on the new release's Deployments, applied with them before anything else of the
    release changes.
    """

    def __init__(
        self,
        target: KubernetesTarget,
        release_id: str,
        manifests: list[dict],
        answers: Answers | None,
        timeout_s: float | None,
    ):
        self.target, self.api = target, target.api
        self.release_id, self.manifests, self.answers = release_id, manifests, answers
        self.timeout_s = timeout_s or _progress_deadline(manifests)
        self.namespace, self.own, self.port, self.model = _smoke_target(manifests)
        self.route_obj, self.new_deps, self.label, self.instance = _release_objects(manifests)
        self.groups = len(self.new_deps)
        self.poll_s = target.poll_s  # how often the controller asks again (servers still terminating)
        self.demand_unknown = False  # the scalers' query did not answer (said once)
        self.events: list[Event] = []
        self.about = {
            "namespace": self.namespace,
            "server": self.api.configuration.host,
            "objects": [f"{obj['kind']}/{obj['metadata']['name']}" for obj in manifests],
        }
        self.applied: list[dict] = []  # the new Deployments once they exist (an undo scales them to zero)
        self.scalers = [obj for obj in manifests if obj["kind"] == "ScaledObject"]  # KEDA's, one per group
        self.old: list[dict] = []  # the serving release's Deployments
        self.old_scalers: list[dict] = []
        self.old_count = 0  # the serving release's servers when the state was read
        self.kept_count = 0  # the new release's servers in every group when the state was read
        self.stale: set[str] = set()  # releases other than these two, left at zero

    def state(self, recovering: bool = False) -> Fleet:
        found = listing(self.api, self.namespace, "deployments", self.instance)
        mine = [d for d in found if _release_of(d) == self.label]
        others = [d for d in found if _release_of(d) != self.label]
        annotated = [d for d in mine if ROLLOUT_ANNOTATION in (d["metadata"].get("annotations") or {})]
        record = (
            RolloutRecord.model_validate_json(annotated[0]["metadata"]["annotations"][ROLLOUT_ANNOTATION])
            if annotated
            else None
        )
        if recovering:  # the release the dead rollout replaced, whatever it runs now
            old_release = record.replacing if record else None
            self.old = [d for d in others if old_release and _release_of(d) == old_release]
        else:
            # the serving release is the one the route gives traffic to; others still running (a keep
            # window a dead controller never finished, an overlapping run's) are stale, not "old"
            weighted = {name for name, weight in self.routed().items() if weight > 0}
            serving = {_release_of(d) for d in others if self._service_of(_release_of(d)) in weighted}
            running = [d for d in others if d["spec"].get("replicas", 0) > 0]
            old_release = sorted(serving)[0] if serving else (_release_of(running[0]) if running else None)
            self.old = [d for d in running if _release_of(d) == old_release]
        self.stale = {_release_of(d) for d in others if d not in self.old}
        old_label = {**self.instance, RELEASE_LABEL: old_release} if old_release else None
        self.old_scalers = listing(self.api, self.namespace, "scaledobjects", old_label) if old_label else []
        if mine:
            self.applied = list(self.new_deps)
        replicas = [d["spec"].get("replicas", 0) for d in mine]
        # what kept objects run in every group (0 where a group is gone): a rollback to them keeps that
        self.kept_count = min(replicas) if mine and len(mine) == len(self.new_deps) else 0
        # servers: one pod in every group. A pause scales a group at once, so a controller killed between
        # two groups leaves them apart: the fewest is what serves (an undo brings the rest back), and
        # where that is none, what any group still runs (so that it is taken to zero)
        counts = [d["spec"].get("replicas", 0) for d in self.old]
        self.old_count = min(counts, default=0) or max(counts, default=0)
        return Fleet(
            release=self.label,
            backend=self.own,
            old_release=old_release,
            old_backend=self._service_of(old_release) if old_release else None,
            old_servers=self.old_count,
            new_servers=min(replicas, default=0),
            new_started=max(replicas, default=0),
            full=max(d["spec"].get("replicas", 1) for d in self.new_deps),
            weights=self.routed(),
            record=record,
        )

    def mark(self, record: RolloutRecord) -> None:
        """The record first (a controller killed after any later change leaves it for `recover`),
        then the serving release's scalers paused: its count is the controller's from then on. On
        new objects the record goes in with the first wave, and the pause right after it."""
        for dep in self.new_deps:  # applied with the first wave, or now onto kept objects
            dep["metadata"].setdefault("annotations", {})[ROLLOUT_ANNOTATION] = record.model_dump_json()
        if self.applied:  # a rollback to kept objects: they keep the servers they run
            for dep in self.new_deps:
                dep["spec"]["replicas"] = self.kept_count
            apply(self.api, self.new_deps, self.target.field_manager, self.timeout_s, self.target.poll_s)
            self._hold(self.old_scalers, self.old_count)

    def remember(self, record: RolloutRecord) -> None:
        """The record rewritten mid-rollout (a spike grew the fleet): on the new Deployments as they
        are (their counts as the controller last set them), or with their first wave where none
        exists yet."""
        for dep in self.new_deps:
            dep["metadata"].setdefault("annotations", {})[ROLLOUT_ANNOTATION] = record.model_dump_json()
        if self.applied:
            apply(self.api, self.applied, self.target.field_manager, self.timeout_s, self.target.poll_s, wait=False)

    def prune(self) -> None:
        removed = self._remove_releases(self.stale)
        if removed:
            self.events.append(ev.Pruned(objects=removed).pair())

    def start(self, servers: int) -> None:
        """Apply the release's objects with `servers` pods per group (first wave), or scale them."""
        if not self.applied:
            for dep in self.new_deps:
                dep["spec"]["replicas"] = servers
            for scaler in self.scalers:  # born paused at the controller's count: KEDA never scales them first
                annotations = scaler["metadata"].setdefault("annotations", {})
                annotations |= {autoscaler.PAUSED_REPLICAS: str(servers), autoscaler.OWNER: self.label}
            self.applied = list(self.new_deps)  # from the first PATCH on, there may be something to undo
            # everything but the route: the release starts unexposed, in its own Service only; its
            # Deployments carry the rollout's record, so the serving release's pause comes after them
            unexposed = [obj for obj in self.manifests if obj["kind"] != "HTTPRoute"]
            deps = [obj for obj in unexposed if obj["kind"] == "Deployment"]
            apply(self.api, deps, self.target.field_manager, 0.0, self.target.poll_s, wait=False)
            self._hold(self.old_scalers, self.old_count)
            rest = [obj for obj in unexposed if obj["kind"] != "Deployment"]
            apply(self.api, rest, self.target.field_manager, self.timeout_s, self.target.poll_s, wait=False)
            wait_rollout(self.api, deps, self.timeout_s, self.target.poll_s)
        else:
            self._hold(self.scalers, servers)
            for dep in self.new_deps:
                scale(self.api, dep, servers)
            wait_rollout(self.api, self.new_deps, self.timeout_s, self.target.poll_s)

    def scale_old(self, servers: int) -> None:
        self._hold(self.old_scalers, servers)
        for dep in self.old:
            scale(self.api, dep, servers)
        wait_rollout(self.api, self.old, self.timeout_s, self.target.poll_s)

    def scale_new(self, servers: int) -> None:
        """The new release down to `servers` (its Deployments that exist: a failed first apply may
        have created only some). To zero, it first leaves the route where it is still named there
        (a weight of 0, or only its own rule): no rule of the Gateway points at a release with no
        pods, and its Pending pods neither hold nor buy GPU nodes; its objects stay."""
        if servers == 0 and self.own in (now := self.routed()):
            self.route({name: weight for name, weight in now.items() if name != self.own})
        if self.applied:
            self._hold(self.scalers, servers)
        for dep in self.applied:
            try:
                scale(self.api, dep, servers)
            except KubernetesError as missing:
                if missing.status != 404:  # never created: nothing to scale
                    raise

    def check(self, step: int, servers: int) -> None:
        """A step's checks: a smoke completion through the model's Gateway to this release by name
        (the route gets the release's own rule first, with no share of the default one), then the
        serving-path accuracy check through its own Service, one `rollout_accuracy` event with its
        table; raises SmokeFailed or AnswersWorse when they fail. Pods rendered before they served
        /tokenizer_info (a rollback to such a release) cannot have their answers checked this way:
        the event says so and the rollout goes on, judged by its analysis."""
        self._name_own()
        smoked = named_smoke(
            self.api,
            self.manifests,
            self.target.smoke_timeout_s,
            self.target.route_timeout_s,
            self.target.smoke_retry_delay_s,
        )
        self.events.append(ev.SmokeTest(ok=True, step=step, **smoked.model_dump()).pair())
        if self.answers is None:
            return
        if TOKENIZER_INFO_FLAG not in _engine_argv(self.new_deps[0]):
            reason = f"the release's pods run without {TOKENIZER_INFO_FLAG} (rendered before it): not checked"
            self.events.append(ev.RolloutAccuracy(step=step, new_servers=servers, skipped=reason).pair())
            log.warning("step %d: served answers %s", step, reason)
            return
        checked = self.answers(step, service_endpoint(self.api, self.namespace, self.own, self.port), self.model)
        self.events.append(
            ev.RolloutAccuracy(step=step, new_servers=servers, summary=checked.summary(), **checked.model_dump()).pair()
        )
        log.info("step %d: served answers %s: %s", step, "pass" if checked.passed else "FAIL", checked.summary())
        if not checked.passed:
            raise AnswersWorse(
                f"step {step}: serving-path accuracy through Service {self.namespace}/{self.own}: "
                + "; ".join(checked.failures)
            )

    def route(self, weights: dict[str, int]) -> None:
        """The default rule's backends and weights; each of them keeps a rule of its own (its checks'
        address), a release left out has none. Returns once the Gateway's status accepted them and
        its data plane serves them (`gateway_serves`, through the Gateway's address): only then has
        the traffic moved, and only then may a step be judged on it."""
        self._apply_route(weights, list(weights))
        if any(weight > 0 for weight in weights.values()):
            gateway_serves(
                self.api,
                self.route_obj,
                weights,
                self.target.route_timeout_s,
                self.target.smoke_retry_delay_s,
                self.target.route_confirmations,
            )
        log.info(
            "route %s: %s",
            self.route_obj["metadata"]["name"],
            ", ".join(f"{n} {w / WEIGHT_TOTAL:.2%}" for n, w in weights.items()) or "no backend",
        )

    def _name_own(self) -> None:
        """The release's own rule in the route (for its checks through the Gateway) where it has none,
        the default rule's weights as they are."""
        now = self._route_now()
        named = named_releases(now) if now else []
        if self.own not in named:
            self._apply_route(route_weights(now) if now else {}, [*named, self.own])

    def _apply_route(self, weights: dict[str, int], named: list[str]) -> None:
        """One conditional apply: it carries the resourceVersion read just before, so a route another
        writer changed since is not overwritten (409: the step fails, the controller undoes it)."""
        route = with_backends(self.route_obj, weights, named)
        now = self._route_now()
        if now is not None:
            route["metadata"] = {**route["metadata"], "resourceVersion": now["metadata"]["resourceVersion"]}
        applied = _call(
            self.api,
            "PATCH",
            object_path(route),
            body=route,
            content_type=APPLY_PATCH,
            query={"fieldManager": self.target.field_manager, "force": "true"},
        )
        self._wait_accepted(applied["metadata"].get("generation", 1))

    def _wait_accepted(self, generation: int) -> None:
        """The route counts as set once its Gateway says so: every parent in its status has observed
        this generation with Accepted and ResolvedRefs True (Gateway API's route status). A route the
        Gateway refuses, or one no Gateway controller reports on within `route_timeout_s`, fails the
        step (the controller then undoes it): weights the Gateway does not serve move no traffic."""
        path = object_path(self.route_obj)
        deadline = time.monotonic() + self.target.route_timeout_s
        while True:
            parents = (_call(self.api, "GET", path).get("status") or {}).get("parents") or []
            current = [
                {c["type"]: c for c in p.get("conditions", []) if c.get("observedGeneration", 0) >= generation}
                for p in parents
            ]
            refused = [
                f"{c['type']} {c.get('reason', '')}: {c.get('message', '')}".strip()
                for conditions in current
                for c in conditions.values()
                if c["type"] in ("Accepted", "ResolvedRefs") and c.get("status") == "False"
            ]
            if refused:
                raise RolloutFailed(
                    f"HTTPRoute {path.rsplit('/', 1)[-1]} refused by its Gateway: " + "; ".join(refused)
                )
            if current and all(
                c.get(kind, {}).get("status") == "True" for c in current for kind in ("Accepted", "ResolvedRefs")
            ):
                return
            if time.monotonic() > deadline:
                raise RolloutFailed(
                    f"HTTPRoute {path.rsplit('/', 1)[-1]}: no Gateway reported it accepted (generation {generation}) "
                    f"within {self.target.route_timeout_s:.0f} s; check promotion.gateway names a Gateway that exists"
                )
            time.sleep(self.target.poll_s)

    def routed(self) -> dict[str, int]:
        """The default rule's backends and weights, and at 0 any release that has only a rule of its own."""
        now = self._route_now()
        if now is None:
            return {}
        weights = route_weights(now)
        return {**weights, **{name: 0 for name in named_releases(now) if name not in weights}}

    def _route_now(self) -> dict | None:
        try:
            return _call(self.api, "GET", object_path(self.route_obj))
        except KubernetesError as exc:
            if exc.status == 404:
                return None
            raise

    def terminating(self) -> int:
        """Servers' worth of devices that pods of the model scaled away still hold. A pod scaled away
        drains first (its preStop, up to its grace period) and its devices are not free until it is
        gone, though its Deployment no longer counts it: before the controller starts servers it
        counts these against live + spare, or the new pods would ask the cluster for devices the
        budget does not have (Pending, or a GPU node the autoscaler buys). Pods of any release of
        the model with a deletionTimestamp, their device limits in servers of this release."""
        pods = listing(self.api, self.namespace, "pods", self.instance)
        going = [pod for pod in pods if pod["metadata"].get("deletionTimestamp")]
        per_server = sum(_devices(d["spec"]["template"]["spec"]) for d in self.new_deps)
        if not per_server:  # no device limits: a server is one pod per replica group
            return math.ceil(len(going) / self.groups)
        return math.ceil(sum(_devices(pod["spec"]) for pod in going) / per_server)

    def demand(self) -> int | None:
        """Servers the model's traffic needs now, as its scalers would ask for them were they not
        paused for the rollout: their trigger's own query (`autoscaler.servers_query`, the same in
        every scaler of every release of the model) asked of the Prometheus it names, capped at
        their maxReplicaCount. None without scalers or without an answer: the rollout goes on as
        sized. The controller grows the fleet to it (`controller.rollout`): while the scalers are
        paused, a spike is the controller's to meet."""
        import requests

        scaler = next(iter(self.old_scalers or self.scalers), None)
        if scaler is None:
            return None
        trigger = scaler["spec"]["triggers"][0]["metadata"]
        try:
            response = requests.get(
                f"{trigger['serverAddress']}/api/v1/query", params={"query": trigger["query"]}, timeout=10
            )
            result = response.json()["data"]["result"]
            value = float(result[0]["value"][1]) if result else math.nan
        except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as exc:
            if not self.demand_unknown:  # once a rollout: it is asked before every wave
                log.warning("the scalers' query did not answer (%s): the fleet stays as the rollout sized it", exc)
            self.demand_unknown = True
            return None
        if math.isnan(value):
            return None
        return min(math.ceil(value), int(scaler["spec"].get("maxReplicaCount", math.ceil(value))))

    def take_down(self) -> bool:
        """After a failure the controller's undo did not see (an error outside it): the release goes
        out of the route and to zero servers unless the route still sends it traffic (then it serves,
        and stays). True when it was taken down."""
        if self.routed().get(self.own, 0) > 0:
            log.warning("release %s keeps its servers: the route sends it traffic", self.release_id)
            return False
        self.scale_new(0)
        self.events.append(ev.ScaledToZero(release=self.own).pair())
        return True

    def settle(self, live: bool) -> None:
        """The scalers of the release that serves now (the new one when live, else the old one) get
        its counts back: KEDA scales it from here on; only those a rollout paused (an operator's
        pause stays), as the cluster holds them now (a missing one is skipped). Nothing else to
        drop: the route is the truth, and the record stays on the Deployments."""
        scalers = self._scalers_now(self.scalers if live else self.old_scalers)  # the side that serves now
        resumed = []
        for patch, scaler in zip(autoscaler.resume(scalers), [s for s in scalers if _owned(s)], strict=True):
            if self._patch_scaler(patch):
                resumed.append(_name(scaler))
        if resumed:
            self.events.append(ev.AutoscalerResumed(scaled_objects=resumed).pair())
        left = [_name(s) for s in scalers if autoscaler.operator_paused(s)]
        if left:
            self.events.append(ev.AutoscalerLeftPaused(scaled_objects=left, by="an operator").pair())

    def _hold(self, scalers: list[dict], servers: int) -> None:
        """Before the controller sets a release's count: its scalers paused at that count (marked as
        this rollout's), and KEDA acknowledging it (their status), so no scaler puts back a count of
        its own meanwhile. A scaler an operator paused is left so; a missing one is skipped."""
        if not scalers:
            return
        now = self._scalers_now(scalers)
        held = [s for s in now if not autoscaler.operator_paused(s)]
        held = [
            s for s, p in zip(held, autoscaler.pause(held, servers, self.label), strict=True) if self._patch_scaler(p)
        ]
        deadline = time.monotonic() + self.target.route_timeout_s
        for scaler in held:
            while not autoscaler.is_paused(_call(self.api, "GET", object_path(scaler)), servers):
                if time.monotonic() > deadline:
                    raise RolloutFailed(
                        f"ScaledObject {_name(scaler)}: KEDA did not confirm the pause at {servers} servers within "
                        f"{self.target.route_timeout_s:.0f} s; is the KEDA operator running?"
                    )
                time.sleep(self.target.poll_s)

    def _scalers_now(self, scalers: list[dict]) -> list[dict]:
        """The scalers as the cluster holds them now; one that is gone (deleted, never applied) is
        skipped and said, never a failed step or rollback."""
        found = []
        for scaler in scalers:
            try:
                now = _call(self.api, "GET", object_path({"kind": "ScaledObject", **scaler}))
            except KubernetesError as exc:
                if exc.status != 404:
                    raise
                self.events.append(ev.AutoscalerMissing(scaled_object=_name(scaler)).pair())
                continue
            found.append({"kind": "ScaledObject", "apiVersion": autoscaler.KEDA_API, **now})
        return found

    def _patch_scaler(self, patch: autoscaler.Patch) -> bool:
        try:
            _call(self.api, "PATCH", patch.path, body=patch.body, content_type=MERGE_PATCH)
        except KubernetesError as exc:
            if exc.status != 404:
                raise
            return False
        return True

    def _service_of(self, release: str) -> str | None:
        """A release's own Service (the one selecting its pods), if it still exists."""
        services = listing(self.api, self.namespace, "services", {**self.instance, RELEASE_LABEL: release})
        return next((s["metadata"]["name"] for s in services if RELEASE_LABEL in s["spec"].get("selector", {})), None)

    def _remove_releases(self, releases: set[str]) -> list[str]:
        """Delete every object of these releases (Deployments, their Services and budgets)."""
        removed = []
        for release in sorted(r for r in releases if r):
            for plural in ("scaledobjects", "deployments", "services", "poddisruptionbudgets"):
                for obj in listing(self.api, self.namespace, plural, {**self.instance, RELEASE_LABEL: release}):
                    delete(self.api, obj)
                    removed.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return removed


def _name(obj: dict) -> str:
    return obj["metadata"]["name"]


def _devices(pod_spec: dict) -> int:
    """The devices (a `*/gpu` resource: amd.com/gpu, nvidia.com/gpu) a pod's containers are limited to."""
    return sum(
        int(value)
        for container in pod_spec.get("containers", [])
        for name, value in ((container.get("resources") or {}).get("limits") or {}).items()
        if name.endswith("/gpu")
    )


def _owned(scaler: dict) -> bool:
    return autoscaler.OWNER in (scaler["metadata"].get("annotations") or {})


def kept_servers(api, manifests: list[dict]) -> int | None:
    """Servers a release's Deployments run now, where they all still exist in the cluster (kept at
    zero, or still serving); None where any is gone (pruned by a later release)."""
    counts = []
    for dep in (obj for obj in manifests if obj["kind"] == "Deployment"):
        try:
            counts.append(_call(api, "GET", object_path(dep))["spec"].get("replicas", 0))
        except KubernetesError as exc:
            if exc.status == 404:
                return None
            raise
    return min(counts) if counts else None


def _release_objects(manifests: list[dict]) -> tuple[dict, list[dict], str, dict[str, str]]:
    """(the model's route, the release's Deployments, its release label, the labels every release
    of the model shares) from its rendered objects."""
    deps = [obj for obj in manifests if obj["kind"] == "Deployment"]
    instance = {k: deps[0]["metadata"]["labels"][k] for k in (INSTANCE_LABEL, MANAGED_BY_LABEL)}
    return _route_of(manifests), deps, _release_of(deps[0]), instance
