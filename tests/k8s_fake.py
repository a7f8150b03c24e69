"""An in-process stand-in for the Kubernetes API server endpoints pipeline.k8s.deploy uses.

Objects are kept by (group/version, plural, namespace, name). Server-side apply (PATCH with
application/apply-patch+yaml and a fieldManager) creates or replaces an object and bumps
metadata.generation when its spec changed; a merge patch of a Deployment's scale subresource
sets its replicas (what `kubectl scale` sends); GET, LIST (with an equality labelSelector) and
DELETE work on the same store. Every change of a Deployment's replicas is kept in `history`
(replicas per release, per replica group), so a test can check how many servers ran at once.
A Deployment controller runs on every change and every read of a Deployment, as the real one
does it: a ReplicaSet per pod template (named by the template's hash, owned by the Deployment;
the older ones scaled to zero), and Pods owned by each ReplicaSet, created and deleted to its
replicas, with the template's labels and a Ready condition; the Deployment's status counts those
pods. Deleting a Deployment deletes what it owns. Pods become ready per scenario of the release
they belong to:

- "ready": the first read after a change shows the rollout in progress (new pods not ready), the
  next one done; or, given `load_s`, each pod turns Ready once `load_s` has passed on the fake's
  `clock` since it was created (what a kubelet's startup probe does for an engine that loads its
  weights), whoever looks: a read, a request through the Gateway or the service proxy;
- "never_ready": the new pods never become ready;
- "smoke_fails": ready, but the service proxy answers completions with HTTP 500.

A release may have a real engine behind its pods (`backends`: release id -> base URL): the
service proxy then forwards every request under .../proxy/ to it (GET and POST, body and
status as the engine answers), the way the API server reaches a pod; without one it answers
completions itself (" Paris.").

A Service's proxy reaches only ready pods that match its selector (their endpoints). Every change
of ready pods is kept in `ready_history` (ready servers per release), so a test can check that
serving capacity, not only what was asked for, never dropped.

Terminating pods: with `terminating_s` S, a pod its ReplicaSet scales away is not gone at once but
Terminating for S seconds on the fake's `clock` (its preStop drain, up to its grace period): it
carries `metadata.deletionTimestamp`, is not Ready (no endpoint, no request through the Gateway),
counts in no ReplicaSet or Deployment status, and still holds the devices it requested. Every
change of the pods is kept in `devices`: (devices all pods request, those of terminating pods),
the devices being each container's `*/gpu` limits, so a test can check what a budget of servers
allows was never exceeded, terminating pods counted.

Every request is recorded (method, path, content type, query, Authorization header) for the tests to inspect.

For preflight: cluster-scoped objects (namespaces, nodes, persistent volumes, CRDs, GatewayClasses,
ClusterRoles and their bindings) are read at their own paths; `install(objs)` puts objects in as an
admin's apply would leave them, with what the API server and the cluster's controllers add (a
namespace's `kubernetes.io/metadata.name` label, a CRD's Established condition, a volume's phase, a
Gateway Programmed only when its GatewayClass exists and is Accepted). A SubjectAccessReview is
answered from the stored Roles, ClusterRoles and bindings as RBAC evaluates them (rules only add;
nothing is allowed that no binding grants). A Service named in `service_urls` ((namespace, name)
-> base URL) is proxied to that URL, query string kept, as the API server reaches its endpoints; a
URL where nothing answers gets the API server's 503 "error trying to reach service".

The Gateway: `send(namespace, route)` is one client request to the model's address, as a Gateway
implementation routes it: a backend Service of the HTTPRoute picked by the weights the route has
now, then one of that Service's ready pods (no ready pod: 503). Each such request is a `Hit` in
`hits`; each request the service proxy answered (the controller's checks of a release) is a
`Check` in `checks`; each applied HTTPRoute is a `RouteChange` in `route_changes`, with the ready
servers of every release at that moment. All three share one sequence (`seq`), so a test can
order them: which release a request reached, and whether its checks had passed before.

The Gateway's controller reports on every applied HTTPRoute in its status, as Gateway API
implementations do: a parent whose `Accepted` condition is True (False for the next
`refuse_routes` routes applied: the listener refuses them) and whose `ResolvedRefs` is False
where a backend Service does not exist, each with the route's generation observed.

The Gateway is an object too (`gateways`: namespace/name, by default the production spec's
`gateway-system/inference`) whose status gives the address of the fake's own data plane, an HTTP
listener that routes each request as a conformant implementation does: the attached HTTPRoute's
rule whose header matches the request (the most header matches first), else its default rule,
then that rule's backends by weight, then one of the Service's ready pods (no rule: 404; no
backend or no ready pod: 503), with the rule's ResponseHeaderModifier applied to the answer. A
request naming a release (`x-model-release`) is a `Hit` in `named_hits` (and, answered, a `Check`
of that release); a GET of /v1/models (what the controller asks to see which weights the data
plane serves: the default rule's answers carry them in its ResponseHeaderModifier) one in
`probes`; any other, like `send`, one in `hits`. The data plane may lag the route's status: with
`route_lag_requests` N, the N requests after each change of a route still take its previous rules,
and with `route_lag_s` S every request within S seconds on the fake's `clock` of the change does
(the status says Accepted at once), as a Gateway whose proxies are reconfigured after its
controller accepted the route. `served_weights` says what the next request would get.

Like a Gateway controller that has not reconciled a change yet, with `route_status_lag_reads` N
the status of a changed route stays the one written for its previous generation (its conditions'
observedGeneration older than the route's) until the N-th read after the change. A second
writer: with `second_writer` N, the next N applies of an object that carry a resourceVersion (a
conditional write) meet another writer's change first, so they are refused (409 Conflict), as an
apply whose resourceVersion is stale always is. Leases: POST creates (409 AlreadyExists when
one has the name), PUT replaces only at the stored resourceVersion (409 Conflict otherwise);
each is kept in `writes` with its holderIdentity.

KEDA, as far as pausing goes: a ScaledObject with `autoscaling.keda.sh/paused-replicas` (applied,
or set by a JSON merge patch) reports Paused with that count in its status and has its target
Deployment scaled to it; a scale of a Deployment whose scaler is not paused at that very count
(KEDA would put its own back) is kept in `scaled_unpaused`. KEDA acting on its own: with
`demand_rps` set (the model's finished requests per second, what Prometheus answers the
trigger's rate), every scaler that is not paused raises its Deployment, at any look at the cluster,
to what its trigger's query asks (`ceil(demand / target)`, within its min and max replica counts);
it never lowers one (the rendered scale-down keeps the highest count for minutes). Each such
change is kept in `keda_scaled`. FakePrometheus answers the same query from `demand_rps`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

RELEASE_LABEL = "model-release/release-id"
CLUSTER_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<gv>[^/]+/[^/]+))/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$")
OBJECT_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<gv>[^/]+/[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?P<sub>/.*)?$"
)


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    query: dict[str, str] = field(default_factory=dict)
    authorization: str | None = None

    @property
    def field_manager(self) -> str | None:
        return self.query.get("fieldManager")


@dataclass
class Hit:
    seq: int
    release: str | None  # None: no ready pod behind the chosen backend (503)
    pod: str | None
    status: int
    named: str | None = None  # the request's x-model-release header (a check of that release)
    answered_as: str | None = None  # the x-model-release header the Gateway's rule set on the answer
    headers: dict[str, str] = field(default_factory=dict)  # every header the rule set on the answer


@dataclass
class Check:
    seq: int
    release: str
    status: int
    via: str = "proxy"  # "proxy": the API server's service proxy; "gateway": the Gateway, by name


GATEWAY_GROUP = "gateway.networking.k8s.io/v1"
RELEASE_HEADER = "x-model-release"


@dataclass
class RouteChange:
    seq: int
    weights: dict[str, int]  # backend Service -> weight
    ready: dict[str, int]  # release -> ready servers when the route changed


class FakeCluster:
    """Start with `with FakeCluster() as fake:`; `fake.client()` is a real kubernetes ApiClient."""

    def __init__(
        self,
        scenario: str = "ready",
        load_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        gateways: tuple[str, ...] = ("gateway-system/inference",),
    ):
        self.scenario = scenario
        self.load_s, self.clock = load_s, clock
        self.terminating_s: float | None = None  # how long a pod scaled away stays Terminating (None: gone at once)
        self.deleted_at: dict[str, float] = {}  # terminating pod -> when its deletion began, on `clock`
        self.devices: list[tuple[int, int]] = []  # after each change of pods: (devices requested, by terminating)
        self.born: dict[str, float] = {}  # pod name -> when it was created, on `clock`
        self.became_ready: dict[str, float] = {}  # pod name -> when it turned Ready, on `clock`
        self.refuse_routes = 0  # the Gateway refuses this many of the next applied routes
        self.scaler_changes: list[tuple[int, str, int | None]] = []  # (seq, ScaledObject, paused count or None)
        # (Deployment, replicas set, its scaler's paused count then): a scale its KEDA scaler would undo
        self.scaled_unpaused: list[tuple[str, int, str | None]] = []
        self.demand_rps: float | None = None  # the model's finished requests per second (None: no scaler acts)
        self.keda_scaled: list[tuple[int, str, int]] = []  # (seq, Deployment, replicas) KEDA set on its own
        self.scenarios: dict[str, str] = {}  # release-id label value -> scenario, overriding the default
        self.backends: dict[str, str] = {}  # release-id label value -> the engine its pods stand for
        self.objects: dict[tuple[str, str, str, str], dict] = {}
        self.versions = 0  # the resourceVersions of objects created or replaced by POST / PUT (Leases)
        self.writes: list[tuple[int, str, str, str | None]] = []  # (seq, POST or PUT, name, holderIdentity)
        self.requests: list[Request] = []
        self.reads: dict[tuple, int] = {}
        self.history: list[dict[str, int]] = []  # after each change: release -> pods of its largest group
        self.ready_history: list[dict[str, int]] = []  # after each change of ready pods: release -> ready servers
        self.hits: list[Hit] = []
        self.checks: list[Check] = []
        self.route_changes: list[RouteChange] = []
        self.ready_changes: list[tuple[int, dict[str, int]]] = []  # (seq, release -> ready servers)
        self.service_urls: dict[tuple[str, str], str] = {}  # (namespace, Service) -> what its endpoints serve
        self.forbidden: set[str] = set()  # paths whose GET the caller may not make (403, as RBAC answers)
        self.seq = 0
        self.rng = random.Random(0)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.route_lag_requests = 0  # requests that still take a route's previous rules after each change
        self.route_lag_s = 0.0  # seconds on `clock` after each change during which requests still take them
        # reads of a route after each change that still show the status its Gateway wrote for the
        # previous generation (its controller has not reconciled the change yet)
        self.route_status_lag_reads = 0
        self.route_status_pending: dict[tuple, tuple[int, dict]] = {}  # route -> (reads left, its new status)
        # the next this many conditional writes of a route meet another writer's change first (an
        # operator's kubectl, a second controller): the stored resourceVersion moved since they read it
        self.second_writer = 0
        self.planes: dict[tuple, _Plane] = {}  # the data plane's view of each HTTPRoute
        self.named_hits: list[Hit] = []
        self.probes: list[Hit] = []  # GETs of /v1/models through the Gateway: which weights it serves
        self.data_plane = ThreadingHTTPServer(("127.0.0.1", 0), _gateway_handler(self))
        self.data_thread = threading.Thread(target=self.data_plane.serve_forever, args=(0.05,), daemon=True)
        for gateway in gateways:
            namespace, name = gateway.split("/")
            self.objects[(GATEWAY_GROUP, "gateways", namespace, name)] = self._gateway(namespace, name)

    def __enter__(self) -> FakeCluster:
        self.thread.start()
        self.data_thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for server in (self.server, self.data_plane):
            server.shutdown()
            server.server_close()

    def _gateway(self, namespace: str, name: str) -> dict:
        """A programmed Gateway whose one HTTP listener is the fake's data plane."""
        return {
            "apiVersion": GATEWAY_GROUP,
            "kind": "Gateway",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()), "generation": 1},
            "spec": {
                "gatewayClassName": "fake",
                "listeners": [
                    {
                        "name": "http",
                        "protocol": "HTTP",
                        "port": self.data_plane.server_address[1],
                        "allowedRoutes": {"namespaces": {"from": "All"}},
                    }
                ],
            },
            "status": {
                "addresses": [{"type": "IPAddress", "value": "127.0.0.1"}],
                "conditions": [{"type": "Accepted", "status": "True"}, {"type": "Programmed", "status": "True"}],
            },
        }

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def client(self):
        from kubernetes import client

        return client.ApiClient(client.Configuration(host=self.url))

    # -------------------------------------------------------- what tests look at

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        for (_gv, kind_plural, ns, obj_name), obj in self.objects.items():
            if (kind_plural, ns, obj_name) == (plural, namespace, name):
                return obj
        return None

    def names(self, plural: str, namespace: str) -> list[str]:
        return sorted(name for (_, p, ns, name) in self.objects if (p, ns) == (plural, namespace))

    def snapshot(self) -> dict:
        with self.lock:
            return copy.deepcopy(self.objects)

    # what each fake has of its own and a `state` leaves out: its servers, their threads, its lock and clock
    MACHINERY = frozenset({"server", "thread", "data_plane", "data_thread", "lock", "clock"})

    def state(self) -> dict:
        """Everything this fake holds (objects, records, counters, its random generator), deep-copied:
        a setup made once that each case `restore`s into a fresh fake (a rollout made once, not once
        per case)."""
        with self.lock:
            held = {name: value for name, value in vars(self).items() if name not in self.MACHINERY}
            return {"data_plane_port": self.data_plane.server_address[1], "held": copy.deepcopy(held)}

    def restore(self, state: dict) -> None:
        """Hold what another fake's `state` held (a deep copy of it: the same state restores again), its
        Gateways' listeners moved to this fake's data plane."""
        with self.lock:
            vars(self).update(copy.deepcopy(state["held"]))
            for (_, plural, _, _), obj in self.objects.items():
                for listener in obj["spec"]["listeners"] if plural == "gateways" else []:
                    if listener.get("port") == state["data_plane_port"]:
                        listener["port"] = self.data_plane.server_address[1]

    def servers(self) -> dict[str, int]:
        """release -> replicas of its largest replica group (one pod per server), as specified now."""
        out: dict[str, int] = {}
        for (_, plural, _, _), obj in self.objects.items():
            if plural == "deployments":
                release = obj["metadata"].get("labels", {}).get(RELEASE_LABEL, "")
                out[release] = max(out.get(release, 0), obj["spec"].get("replicas", 1))
        return out

    def ready_pods(self) -> dict[str, int]:
        """release -> its ready pods (summed over its replica groups)."""
        out: dict[str, int] = {}
        with self.lock:
            for pod in self._objects("pods"):
                release = pod["metadata"]["labels"].get(RELEASE_LABEL, "")
                out[release] = out.get(release, 0) + _ready(pod)
        return out

    def ready_servers(self) -> dict[str, int]:
        """release -> servers whose every replica group has a ready pod (the fewest ready pods of its groups)."""
        with self.lock:
            return self.ready_servers_locked()

    def ready_servers_locked(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for deployment in self._objects("deployments"):
            meta = deployment["metadata"]
            ready = sum(
                _ready(pod)
                for _, rs in self._owned(meta["namespace"], "replicasets", meta["uid"])
                for _, pod in self._owned(meta["namespace"], "pods", rs["metadata"]["uid"])
            )
            release = meta.get("labels", {}).get(RELEASE_LABEL, "")
            out[release] = min(out.get(release, ready), ready)
        return out

    def _objects(self, plural: str) -> list[dict]:
        return [obj for (_, kind_plural, _, _), obj in self.objects.items() if kind_plural == plural]

    def scenario_for(self, labels: dict[str, str] | None) -> str:
        return self.scenarios.get((labels or {}).get(RELEASE_LABEL, ""), self.scenario)

    # -------------------------------------------------------- behaviour

    def apply(self, key: tuple, body: dict) -> tuple[int, dict]:
        with self.lock:
            old = self.objects.get(key)
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            carried = meta.get("resourceVersion")
            if carried is not None and old is not None and self.second_writer > 0:
                self.second_writer -= 1
                old["metadata"]["resourceVersion"] = str(int(old["metadata"]["resourceVersion"]) + 1)
                old["metadata"].setdefault("annotations", {})["edited-by"] = "someone else"
                self.writes.append((self._next(), "PATCH", key[3], "second writer"))
            if carried is not None and carried != (old or {}).get("metadata", {}).get("resourceVersion"):
                # an apply carrying a resourceVersion is conditional on it, as the API server treats one
                message = f'Operation cannot be fulfilled on {key[1]} "{key[3]}": the object has been modified'
                return 409, _status(409, message, "Conflict")
            if old is None:
                meta.update(uid=str(uuid.uuid4()), generation=1, resourceVersion="1")
                code = 201
            else:
                changed = old.get("spec") != obj.get("spec")
                meta.update(
                    uid=old["metadata"]["uid"],
                    generation=old["metadata"]["generation"] + (1 if changed else 0),
                    resourceVersion=str(int(old["metadata"]["resourceVersion"]) + 1),
                )
                obj["status"] = old.get("status", {})
                code = 200
            self.objects[key] = obj
            self.reads[key] = 0
            if obj.get("kind") == "HTTPRoute":
                status = self._route_status(obj)
                if old is not None and self.route_status_lag_reads > 0:
                    obj["status"] = copy.deepcopy(old.get("status") or {})  # the previous generation's, for now
                    self.route_status_pending[key] = (self.route_status_lag_reads, status)
                else:
                    obj["status"] = status
                weights = {b["name"]: b.get("weight", 1) for r in _default_rules(obj) for b in r.get("backendRefs", [])}
                self.route_changes.append(RouteChange(self._next(), weights, self.ready_servers_locked()))
                plane = self.planes.setdefault(key, _Plane())
                if plane.pending is not None and self._followed(plane):  # a change it had followed already
                    plane.serving = plane.pending
                plane.pending, plane.countdown = copy.deepcopy(obj["spec"]["rules"]), self.route_lag_requests
                plane.changed_at = self.clock()
            if obj.get("kind") == "Deployment":
                self.history.append(self.servers())
                self._reconcile(key)
            if obj.get("kind") == "ScaledObject":
                self._keda(obj)
            return code, copy.deepcopy(obj)

    def create(self, key: tuple, body: dict) -> tuple[int, dict]:
        """A POST of a new object (a Lease): 409 AlreadyExists where one has the name."""
        with self.lock:
            if key in self.objects:
                return 409, _status(409, f'{key[1]} "{key[3]}" already exists', "AlreadyExists")
            obj = copy.deepcopy(body)
            obj.setdefault("metadata", {}).update(uid=str(uuid.uuid4()), generation=1, resourceVersion=self._version())
            self.objects[key] = obj
            self.writes.append((self._next(), "POST", key[3], (obj.get("spec") or {}).get("holderIdentity")))
            return 201, copy.deepcopy(obj)

    def replace(self, key: tuple, body: dict) -> tuple[int, dict]:
        """A PUT: the whole object replaced, only where the resourceVersion it carries is the one stored
        (409 Conflict otherwise: someone wrote it since it was read), as the API server's update does."""
        with self.lock:
            old = self.objects.get(key)
            if old is None:
                return 404, _status(404, f'{key[1]} "{key[3]}" not found')
            carried = (body.get("metadata") or {}).get("resourceVersion")
            if carried != old["metadata"]["resourceVersion"]:
                message = f'Operation cannot be fulfilled on {key[1]} "{key[3]}": the object has been modified'
                return 409, _status(409, message, "Conflict")
            obj = copy.deepcopy(body)
            obj["metadata"].update(
                uid=old["metadata"]["uid"], generation=old["metadata"]["generation"], resourceVersion=self._version()
            )
            self.objects[key] = obj
            self.writes.append((self._next(), "PUT", key[3], (obj.get("spec") or {}).get("holderIdentity")))
            return 200, copy.deepcopy(obj)

    def _version(self) -> str:
        self.versions += 1
        return str(self.versions)

    def merge_scaler(self, key: tuple, patch: dict) -> tuple[int, dict]:
        """A JSON merge patch of a ScaledObject's annotations (what the controller pauses it with)."""
        with self.lock:
            obj = self.objects.get(key)
            if obj is None:
                return 404, _status(404, f'scaledobjects.keda.sh "{key[3]}" not found')
            annotations = obj["metadata"].setdefault("annotations", {})
            for name, value in (patch.get("metadata", {}).get("annotations") or {}).items():
                if value is None:
                    annotations.pop(name, None)
                else:
                    annotations[name] = value
            self._keda(obj)
            return 200, copy.deepcopy(obj)

    def _keda(self, scaler: dict) -> None:
        """What KEDA's operator does with a paused-replicas annotation (lock held): its Paused
        condition and count in the status, and the target Deployment scaled to that count. An
        unpaused scaler is left alone here (no metrics drive it in this fake)."""
        paused = (scaler["metadata"].get("annotations") or {}).get("autoscaling.keda.sh/paused-replicas")
        status = scaler.setdefault("status", {})
        if paused is None:
            status["conditions"] = [{"type": "Paused", "status": "False"}]
            status.pop("pausedReplicaCount", None)
            self.scaler_changes.append((self._next(), scaler["metadata"]["name"], None))
            return
        replicas = int(paused)
        status["conditions"] = [{"type": "Paused", "status": "True"}]
        status["pausedReplicaCount"] = replicas
        self.scaler_changes.append((self._next(), scaler["metadata"]["name"], replicas))
        target = ("apps/v1", "deployments", scaler["metadata"]["namespace"], scaler["spec"]["scaleTargetRef"]["name"])
        deployment = self.objects.get(target)
        if deployment is not None and deployment["spec"].get("replicas") != replicas:
            deployment["spec"]["replicas"] = replicas
            deployment["metadata"]["generation"] += 1
            self.reads[target] = 0
            self.history.append(self.servers())
            self._reconcile(target)

    def wanted(self, query: str) -> float | None:
        """What the scalers' query (`ceil(<demand> / <target>)`) answers with `demand_rps`."""
        target = re.search(r"/ ([0-9.eE+-]+)\)$", query)
        if self.demand_rps is None or target is None:
            return None
        return float(math.ceil(self.demand_rps / float(target[1]) - 1e-9))

    def _autoscale(self) -> None:
        """KEDA's scalers that are not paused raise their Deployments to what their query asks (lock held)."""
        if self.demand_rps is None:
            return
        for scaler in self._objects("scaledobjects"):
            annotations = scaler["metadata"].get("annotations") or {}
            if "autoscaling.keda.sh/paused-replicas" in annotations or "autoscaling.keda.sh/paused" in annotations:
                continue
            wanted = self.wanted(scaler["spec"]["triggers"][0]["metadata"]["query"])
            if wanted is None:
                continue
            spec = scaler["spec"]
            replicas = int(min(max(wanted, spec.get("minReplicaCount", 0)), spec.get("maxReplicaCount", 100)))
            key = ("apps/v1", "deployments", scaler["metadata"]["namespace"], spec["scaleTargetRef"]["name"])
            deployment = self.objects.get(key)
            if deployment is None or deployment["spec"].get("replicas", 0) >= replicas:
                continue
            deployment["spec"]["replicas"] = replicas
            deployment["metadata"]["generation"] += 1
            deployment["metadata"]["resourceVersion"] = str(int(deployment["metadata"]["resourceVersion"]) + 1)
            self.reads[key] = 0
            self.keda_scaled.append((self._next(), key[3], replicas))
            self.history.append(self.servers())
            self._reconcile(key)

    def scale(self, key: tuple, patch: dict) -> tuple[int, dict]:
        with self.lock:
            obj = self.objects.get(key)
            if obj is None:
                return 404, _status(404, f'deployments.apps "{key[3]}" not found')
            replicas = patch.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return 422, _status(422, f"spec.replicas: Invalid value: {replicas!r}")
            for scaler in self._objects("scaledobjects"):  # KEDA would put its own count back
                if scaler["spec"]["scaleTargetRef"]["name"] == key[3]:
                    paused = (scaler["metadata"].get("annotations") or {}).get("autoscaling.keda.sh/paused-replicas")
                    if paused != str(replicas):
                        self.scaled_unpaused.append((key[3], replicas, paused))
            if obj["spec"].get("replicas") != replicas:
                obj["spec"]["replicas"] = replicas
                obj["metadata"]["generation"] += 1
                obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
                self.reads[key] = 0
                self.history.append(self.servers())
                self._reconcile(key)
            return 200, {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {"name": key[3], "namespace": key[2]},
                "spec": {"replicas": replicas},
                "status": {"replicas": (obj.get("status") or {}).get("replicas", 0)},
            }

    def read(self, key: tuple) -> dict | None:
        with self.lock:
            self._autoscale()
            obj = self.objects.get(key)
            if obj is None:
                return None
            if obj.get("kind") == "Deployment":
                self.reads[key] = self.reads.get(key, 0) + 1
                self._reconcile(key)
            if key in self.route_status_pending:  # the Gateway's controller catches up after some reads
                left, status = self.route_status_pending.pop(key)
                if left <= 1:
                    obj["status"] = status
                else:
                    self.route_status_pending[key] = (left - 1, status)
            return copy.deepcopy(obj)

    # -------------------------------------------------------- the Deployment controller (lock held)

    def _reconcile(self, key: tuple) -> None:
        """The Deployment's ReplicaSets and their Pods to its spec, then its status from those pods."""
        deployment = self.objects[key]
        gv, _, ns, name = key
        meta, spec = deployment["metadata"], deployment["spec"]
        template = spec["template"]
        pod_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": meta["uid"]}
        current = (gv, "replicasets", ns, f"{name}-{pod_hash}")
        if current not in self.objects:
            labels = {**template["metadata"].get("labels", {}), "pod-template-hash": pod_hash}
            self.objects[current] = {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": _meta(current[3], ns, labels, owner),
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": labels},
                    "template": {**template, "metadata": {**template["metadata"], "labels": labels}},
                },
            }
        ready_now = self.scenario_for(template["metadata"].get("labels")) != "never_ready" and self.reads[key] >= 2
        for rs_key, rs in self._owned(ns, "replicasets", meta["uid"]):
            rs["spec"]["replicas"] = spec.get("replicas", 1) if rs_key == current else 0
            rs_meta = rs["metadata"]
            pods = self._running(ns, rs_meta["uid"])
            for pod_key, pod in pods[rs["spec"]["replicas"] :]:
                self._terminate(pod_key, pod)
            for _ in range(rs["spec"]["replicas"] - len(pods)):
                pod_name = f"{rs_meta['name']}-{uuid.uuid4().hex[:5]}"
                rs_owner = {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": rs_meta["name"],
                    "uid": rs_meta["uid"],
                }
                self.born[pod_name] = self.clock()
                self.objects[("v1", "pods", ns, pod_name)] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": _meta(pod_name, ns, rs["spec"]["selector"]["matchLabels"], rs_owner),
                    "spec": copy.deepcopy(template["spec"]),
                    "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]},
                }
            if ready_now and rs_key == current and self.load_s is None:
                for _, pod in self._running(ns, rs_meta["uid"]):
                    self._set_ready(pod)
        self._kubelet()
        pods = [
            pod
            for _, rs in self._owned(ns, "replicasets", meta["uid"])
            for _, pod in self._running(ns, rs["metadata"]["uid"])
        ]
        updated = [pod for _, pod in self._running(ns, self.objects[current]["metadata"]["uid"])]
        ready = sum(_ready(pod) for pod in updated)
        want = spec.get("replicas", 1)
        available = ready >= want
        deployment["status"] = {
            "observedGeneration": meta["generation"],
            "replicas": len(pods),
            "updatedReplicas": len(updated),
            "readyReplicas": ready,
            "availableReplicas": ready,
            **({"unavailableReplicas": len(pods) - ready} if len(pods) > ready else {}),
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if available else "False",
                    "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                    "message": f"Deployment {'has' if available else 'does not have'} minimum availability.",
                }
            ],
        }
        self._note_ready()

    def install(self, objs: list[dict]) -> None:
        """Objects as an applied install leaves them, with what the server and controllers add."""
        with self.lock:
            for body in objs:
                obj = copy.deepcopy(body)
                meta = obj.setdefault("metadata", {})
                meta.update(uid=str(uuid.uuid4()), generation=1, resourceVersion="1")
                kind = obj["kind"]
                if kind == "Namespace":
                    meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
                if kind == "CustomResourceDefinition":
                    obj["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
                if kind == "PersistentVolume":
                    obj["status"] = {"phase": "Available"}
                self.objects[(obj["apiVersion"], plural_of(kind), meta.get("namespace", ""), meta["name"])] = obj
            for (gv, plural, _, _), gateway in self.objects.items():
                if (gv, plural) == ("gateway.networking.k8s.io/v1", "gateways"):
                    cls = self.objects.get(
                        ("gateway.networking.k8s.io/v1", "gatewayclasses", "", gateway["spec"]["gatewayClassName"])
                    )
                    accepted = any(
                        c["type"] == "Accepted" and c["status"] == "True"
                        for c in ((cls or {}).get("status") or {}).get("conditions", [])
                    )
                    state = (
                        {"status": "True", "reason": "Programmed"}
                        if accepted
                        else {"status": "False", "reason": "Pending", "message": "no controller for its class"}
                    )
                    gateway["status"] = {"conditions": [{"type": "Accepted", **state}, {"type": "Programmed", **state}]}

    def authorize(self, spec: dict) -> bool:
        """RBAC, as the API server's authorizer answers a SubjectAccessReview (lock held)."""
        user, groups = spec.get("user", ""), set(spec.get("groups") or [])
        attrs = spec.get("resourceAttributes") or {}
        namespace = attrs.get("namespace", "")
        resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")

        def subject_matches(subject: dict) -> bool:
            if subject["kind"] == "ServiceAccount":
                return user == f"system:serviceaccount:{subject.get('namespace')}:{subject['name']}"
            return subject["name"] == user if subject["kind"] == "User" else subject["name"] in groups

        def rule_allows(rule: dict) -> bool:
            return (
                (attrs.get("group", "") in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
                and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
                and (attrs.get("verb") in rule.get("verbs", []) or "*" in rule.get("verbs", []))
                and (not rule.get("resourceNames") or attrs.get("name") in rule["resourceNames"])
            )

        rbac = "rbac.authorization.k8s.io/v1"
        bindings = [b for (gv, p, ns, _), b in self.objects.items() if gv == rbac and p == "clusterrolebindings"]
        if namespace:
            bindings += [
                b for (gv, p, ns, _), b in self.objects.items() if (gv, p, ns) == (rbac, "rolebindings", namespace)
            ]
        for binding in bindings:
            if not any(subject_matches(s) for s in binding.get("subjects", [])):
                continue
            ref = binding["roleRef"]
            role_ns = binding["metadata"].get("namespace", "") if ref["kind"] == "Role" else ""
            role = self.objects.get((rbac, plural_of(ref["kind"]), role_ns, ref["name"]))
            if role and any(rule_allows(rule) for rule in role.get("rules", [])):
                return True
        return False

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _set_ready(self, pod: dict) -> None:
        if not _ready(pod):
            pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
            self.became_ready[pod["metadata"]["name"]] = self.clock()

    def _running(self, ns: str, rs_uid: str) -> list[tuple[tuple, dict]]:
        """A ReplicaSet's pods that are not terminating (those it counts)."""
        return [(k, p) for k, p in self._owned(ns, "pods", rs_uid) if "deletionTimestamp" not in p["metadata"]]

    def _terminate(self, key: tuple, pod: dict) -> None:
        """A pod scaled away (lock held): gone at once, or Terminating for `terminating_s`."""
        if self.terminating_s is None:
            del self.objects[key]
            return
        pod["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod["metadata"]["deletionGracePeriodSeconds"] = pod["spec"].get("terminationGracePeriodSeconds", 30)
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}
        self.deleted_at[pod["metadata"]["name"]] = self.clock()

    def _reap(self) -> None:
        """Terminating pods whose time is up are gone (lock held); `devices` notes any change."""
        if self.deleted_at:
            now = self.clock()
            for key in [k for k in self.objects if k[1] == "pods" and k[3] in self.deleted_at]:
                if now - self.deleted_at[key[3]] >= (self.terminating_s or 0):
                    del self.objects[key], self.deleted_at[key[3]]
        self._note_devices()

    def _note_devices(self) -> None:
        held = terminating = 0
        for pod in self._objects("pods"):
            count = sum(
                int(value)
                for container in pod["spec"].get("containers", [])
                for name, value in ((container.get("resources") or {}).get("limits") or {}).items()
                if name.endswith("/gpu")
            )
            held += count
            terminating += count if "deletionTimestamp" in pod["metadata"] else 0
        if not self.devices or self.devices[-1] != (held, terminating):
            self.devices.append((held, terminating))

    def _kubelet(self) -> None:
        """Terminating pods whose time is up go; with a load time, every pod whose engine has loaded
        by now turns Ready (lock held)."""
        self._reap()
        if self.load_s is None:
            return
        now = self.clock()
        for (_, plural, _, name), pod in list(self.objects.items()):
            if plural != "pods" or _ready(pod) or now - self.born.get(name, now) < self.load_s:
                continue
            if self.scenario_for(pod["metadata"].get("labels")) != "never_ready":
                self._set_ready(pod)
        self._note_ready()

    def _route_status(self, route: dict) -> dict:
        """What a Gateway controller reports on an applied route (lock held)."""
        ns, generation = route["metadata"]["namespace"], route["metadata"]["generation"]
        missing = [
            b["name"]
            for r in route["spec"]["rules"]
            for b in r.get("backendRefs", [])
            if ("v1", "services", ns, b["name"]) not in self.objects
        ]
        accepted = {"type": "Accepted", "observedGeneration": generation}
        refused = self.refuse_routes > 0
        self.refuse_routes -= refused
        accepted |= (
            {"status": "False", "reason": "NotAllowedByListeners", "message": "no listener allows this route"}
            if refused
            else {"status": "True", "reason": "Accepted", "message": ""}
        )
        resolved = {"type": "ResolvedRefs", "observedGeneration": generation}
        resolved |= (
            {"status": "False", "reason": "BackendNotFound", "message": f"Service {', '.join(missing)} not found"}
            if missing
            else {"status": "True", "reason": "ResolvedRefs", "message": ""}
        )
        parents = route["spec"].get("parentRefs", [])
        return {
            "parents": [
                {"parentRef": parent, "controllerName": "fake.example/gateway", "conditions": [accepted, resolved]}
                for parent in parents
            ]
        }

    def _ready_pods_of(self, namespace: str, service: str) -> list[dict]:
        svc = self.objects.get(("v1", "services", namespace, service))
        if svc is None:
            return []
        return [
            obj
            for (_, plural, ns, _), obj in self.objects.items()
            if (plural, ns) == ("pods", namespace)
            and _ready(obj)
            and _selects(svc["spec"]["selector"], obj["metadata"]["labels"])
        ]

    def send(self, namespace: str, route: str) -> Hit:
        """One client request to the model's address through the Gateway (see the module's docstring)."""
        with self.lock:
            hit, _ = self._through_gateway((GATEWAY_GROUP, "httproutes", namespace, route), {})
            self.hits.append(hit)
            return hit

    def _rules_served(self, key: tuple) -> list[dict]:
        """The route's rules as the data plane serves them now (lock held): a change is followed only
        after `route_lag_requests` requests took the previous rules, and `route_lag_s` has passed."""
        plane = self.planes.get(key)
        if plane is None:
            return []
        if plane.pending is not None:
            if plane.countdown > 0:
                plane.countdown -= 1
            elif self._followed(plane):
                plane.serving, plane.pending = plane.pending, None
        return plane.serving or []

    def _followed(self, plane: _Plane) -> bool:
        """The data plane serves the route's last change from the next request on (lock held)."""
        return plane.countdown <= 0 and self.clock() - plane.changed_at >= self.route_lag_s

    def served_weights(self, namespace: str, route: str) -> dict[str, int]:
        """The default rule's backends and weights the next client request through the Gateway gets
        (a look: no request is counted)."""
        with self.lock:
            plane = self.planes.get((GATEWAY_GROUP, "httproutes", namespace, route))
            if plane is None:
                return {}
            followed = plane.pending is not None and self._followed(plane)
            rules = (plane.pending if followed else plane.serving) or []
            return {
                b["name"]: b.get("weight", 1)
                for r in _default_rules({"spec": {"rules": rules}})
                for b in r.get("backendRefs", [])
            }

    def _through_gateway(self, key: tuple, headers: dict[str, str]) -> tuple[Hit, dict]:
        """Route one request (lock held): the Hit, and the rule that took it ({} where none did)."""
        self._kubelet()
        rules = self._rules_served(key)
        wanted = {k.lower(): v for k, v in headers.items()}
        matching = [
            (len(m.get("headers", [])), rule)
            for rule in rules
            for m in rule.get("matches", [{}])
            if all(wanted.get(h["name"].lower()) == h["value"] for h in m.get("headers", []))
        ]
        named = wanted.get(RELEASE_HEADER)
        if not matching:
            return Hit(self._next(), None, None, 404, named), {}
        rule = max(matching, key=lambda match: match[0])[1]
        backends = [(b["name"], b.get("weight", 1)) for b in rule.get("backendRefs", []) if b.get("weight", 1) > 0]
        set_headers = _response_headers(rule)
        answered_as = set_headers.get(RELEASE_HEADER)
        hit = Hit(self._next(), None, None, 503, named, answered_as, set_headers)
        if backends:
            (service,) = self.rng.choices([n for n, _ in backends], weights=[w for _, w in backends])
            pods = self._ready_pods_of(key[2], service)
            if pods:
                pod = self.rng.choice(pods)
                release = pod["metadata"]["labels"].get(RELEASE_LABEL)
                hit = Hit(hit.seq, release, pod["metadata"]["name"], 200, named, answered_as, set_headers)
        return hit, rule

    def gateway_request(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, dict, dict]:
        """One request to the data plane's listener: (status, body, response headers)."""
        with self.lock:
            keys = [
                key
                for key, obj in self.objects.items()
                if key[1] == "httproutes"
                and any(
                    (p.get("namespace") or key[2], p["name"]) in self._gateway_names()
                    for p in obj["spec"].get("parentRefs", [])
                )
            ]
            if keys:
                hit, rule = self._through_gateway(sorted(keys)[0], headers)
            else:
                hit, rule = Hit(self._next(), None, None, 404, headers.get(RELEASE_HEADER)), {}
            named = hit.named is not None
            probe = (method, path) == ("GET", "/v1/models")
            (self.named_hits if named else self.probes if probe else self.hits).append(hit)
            pod = copy.deepcopy(self.get("pods", keys[0][2], hit.pod)) if hit.pod else None
            if named and hit.status == 200 and hit.release:
                self.checks.append(Check(hit.seq, hit.release, 200, via="gateway"))
        answer_headers = dict(hit.headers)
        if pod is None:
            status = 404 if not rule else 503
            return status, {"message": "no route" if not rule else "no healthy upstream"}, {}
        code, body = self.pod_answer(pod, method, path, raw)
        return code, body, answer_headers

    def _gateway_names(self) -> set[tuple[str, str]]:
        return {(ns, name) for (_, plural, ns, name) in self.objects if plural == "gateways"}

    def pod_answer(self, pod: dict, method: str, rest: str, raw: bytes) -> tuple[int, dict]:
        """What one ready pod answers: its release's engine where it has one, else the fake's own
        completion (" Paris."); a "smoke_fails" release's engine answers HTTP 500."""
        labels = pod["metadata"]["labels"]
        if self.scenario_for(labels) == "smoke_fails":
            return 500, {"object": "error", "message": "EngineCore died", "code": 500}
        backend = self.backends.get(labels.get(RELEASE_LABEL, ""))
        if backend is not None:
            return _forward(method, backend + rest, raw)
        argv = pod["spec"]["containers"][0]["command"]
        return _completion(method, rest, raw, {argv[argv.index("--served-model-name") + 1]})

    def _owned(self, ns: str, plural: str, owner_uid: str) -> list[tuple[tuple, dict]]:
        return [
            (key, obj)
            for key, obj in self.objects.items()
            if key[1:3] == (plural, ns)
            and any(ref["uid"] == owner_uid for ref in obj["metadata"].get("ownerReferences", []))
        ]

    def _delete_owned(self, ns: str, owner_uid: str) -> None:
        """Garbage collection: what the object owns goes with it (ReplicaSets, then their pods)."""
        for plural in ("replicasets", "pods"):
            for key, obj in self._owned(ns, plural, owner_uid):
                del self.objects[key]
                self.deleted_at.pop(key[3], None)
                self._delete_owned(ns, obj["metadata"]["uid"])

    def _note_ready(self) -> None:
        groups = self.ready_servers_locked()
        if not self.ready_history or self.ready_history[-1] != groups:
            self.ready_history.append(groups)
        if not self.ready_changes or self.ready_changes[-1][1] != groups:
            self.ready_changes.append((self._next(), groups))

    def proxy(self, namespace: str, service: str, method: str, rest: str, raw: bytes) -> tuple[int, dict]:
        """A request through the service proxy to `rest` on one of the Service's ready pods."""
        svc = self.get("services", namespace, service)
        if svc is None:
            return 404, _status(404, f'services "{service}" not found')
        if (namespace, service) in self.service_urls:
            try:
                return _forward(method, self.service_urls[(namespace, service)] + rest, raw)
            except OSError as exc:
                return 503, _status(503, f"error trying to reach service: dial tcp: {exc}")
        selector = svc["spec"]["selector"]
        if self.scenario_for(selector) == "smoke_fails":
            return 500, {"object": "error", "message": "EngineCore died", "code": 500}
        served, releases = set(), set()
        with self.lock:
            self._kubelet()
            for (_, plural, ns, _), obj in self.objects.items():
                labels = obj["metadata"].get("labels", {})
                if (plural, ns) == ("pods", namespace) and _ready(obj) and _selects(selector, labels):
                    argv = obj["spec"]["containers"][0]["command"]
                    served.add(argv[argv.index("--served-model-name") + 1])
                    releases.add(labels.get(RELEASE_LABEL, ""))
        if not served:
            return 503, _status(503, f'no endpoints available for service "{service}"')
        with self.lock:
            self.checks.append(Check(self._next(), sorted(releases)[0], 200))
        backend = next((self.backends[r] for r in sorted(releases) if r in self.backends), None)
        if backend is not None:
            return _forward(method, backend + rest, raw)
        return _completion(method, rest, raw, served)


def _completion(method: str, rest: str, raw: bytes, served: set[str]) -> tuple[int, dict]:
    """What a vLLM engine serving `served` answers: a completion, its model list, or its 404 for another
    path or model."""
    if (method, rest) == ("GET", "/v1/models"):
        return 200, {"object": "list", "data": [{"id": model, "object": "model"} for model in sorted(served)]}
    if (method, rest) != ("POST", "/v1/completions"):
        return 404, _status(404, f"{rest}: this fake answers completions only")
    body = json.loads(raw or b"{}")
    if body.get("model") not in served:
        return 404, {"object": "error", "message": f"The model `{body.get('model')}` does not exist.", "code": 404}
    return 200, {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": body["model"],
        "choices": [{"index": 0, "text": " Paris.", "finish_reason": "length"}],
    }


@dataclass
class _Plane:
    """The data plane's view of one HTTPRoute: the rules it serves, and a change it has yet to follow."""

    serving: list[dict] | None = None
    pending: list[dict] | None = None
    countdown: int = 0
    changed_at: float = 0.0  # when the route last changed, on the fake's clock


def _default_rules(route: dict) -> list[dict]:
    return [r for r in route["spec"]["rules"] if not any(m.get("headers") for m in r.get("matches", []))]


def _response_headers(rule: dict) -> dict[str, str]:
    """The headers a rule's ResponseHeaderModifier sets on its answers (names lowercased)."""
    return {
        header["name"].lower(): header["value"]
        for item in rule.get("filters", [])
        if item.get("type") == "ResponseHeaderModifier"
        for header in item["responseHeaderModifier"].get("set", [])
    }


def _gateway_handler(fake: FakeCluster):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items()}
            code, body, extra = fake.gateway_request(self.command, urlsplit(self.path).path, headers, raw)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in extra.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

    return Handler


def _meta(name: str, namespace: str, labels: dict[str, str], owner: dict) -> dict:
    """An owned object's metadata, as the controllers set it (the owner is their controller)."""
    reference = {**owner, "controller": True, "blockOwnerDeletion": True}
    uid = str(uuid.uuid4())
    return {"name": name, "namespace": namespace, "labels": dict(labels), "uid": uid, "ownerReferences": [reference]}


def _ready(pod: dict) -> int:
    conditions = (pod.get("status") or {}).get("conditions", [])
    return int(any(c["type"] == "Ready" and c["status"] == "True" for c in conditions))


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _status(code: int, message: str, reason: str | None = None) -> dict:
    reason = reason or {
        404: "NotFound",
        415: "UnsupportedMediaType",
        400: "BadRequest",
        422: "Invalid",
        503: "ServiceUnavailable",
        403: "Forbidden",
    }.get(code, "")
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(labels: dict, selector: str) -> bool:
    pairs = [part.split("=", 1) for part in selector.split(",") if part]
    return all((labels or {}).get(k) == v for k, v in pairs)


def _handler(fake: FakeCluster):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self):
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            fake.requests.append(
                Request(
                    self.command,
                    url.path,
                    self.headers.get("Content-Type", ""),
                    query,
                    self.headers.get("Authorization"),
                )
            )
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return url.path, query, raw

        def do_GET(self) -> None:
            path, query, raw = self._route()
            if path == "/version":
                return self._send(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake"})
            if path in fake.forbidden:
                return self._send(403, _status(403, f'cannot get path "{path}": forbidden'))
            match = OBJECT_PATH.match(path) or CLUSTER_PATH.match(path)
            if self._proxied(match, raw):
                return None
            if not match:
                return self._send(404, _status(404, f"no route {path}"))
            ns = match["ns"] if "ns" in match.groupdict() else ""
            gv, plural, name = match["core"] or match["gv"], match["plural"], match["name"]
            if name is None:
                with fake.lock:
                    if plural == "pods":
                        fake._reap()
                    keys = [k for k in fake.objects if k[:3] == (gv, plural, ns)]
                items = [fake.read(k) for k in keys]
                items = [
                    i for i in items if i and _matches(i["metadata"].get("labels"), query.get("labelSelector", ""))
                ]
                return self._send(200, {"kind": "List", "apiVersion": gv, "items": items})
            obj = fake.read((gv, plural, ns, name))
            if obj is None:
                return self._send(404, _status(404, f'{plural} "{name}" not found'))
            return self._send(200, obj)

        def do_PATCH(self) -> None:
            path, query, raw = self._route()
            match = OBJECT_PATH.match(path)
            if not match or not match["name"]:
                return self._send(404, _status(404, f"no route {path}"))
            key = (match["core"] or match["gv"], match["plural"], match["ns"], match["name"])
            if match["sub"] == "/scale" and match["plural"] == "deployments":
                if self.headers.get("Content-Type") != "application/merge-patch+json":
                    return self._send(415, _status(415, "this fake scales by merge patch only"))
                return self._send(*fake.scale(key, json.loads(raw)))
            if match["sub"]:
                return self._send(404, _status(404, f"no route {path}"))
            if (
                self.headers.get("Content-Type") == "application/merge-patch+json"
                and match["plural"] == "scaledobjects"
            ):
                return self._send(*fake.merge_scaler(key, json.loads(raw)))
            if self.headers.get("Content-Type") != "application/apply-patch+yaml":
                return self._send(415, _status(415, "this fake only takes server-side apply"))
            if not query.get("fieldManager"):
                return self._send(400, _status(400, "fieldManager is required for apply requests"))
            body = json.loads(raw)  # the client sends JSON, which is YAML
            if body["metadata"]["name"] != match["name"] or body["metadata"].get("namespace") != match["ns"]:
                return self._send(400, _status(400, "the name or namespace of the object does not match the URL"))
            code, obj = fake.apply((match["core"] or match["gv"], match["plural"], match["ns"], match["name"]), body)
            return self._send(code, obj)

        def do_DELETE(self) -> None:
            path, _, _ = self._route()
            match = OBJECT_PATH.match(path)
            key = (match["core"] or match["gv"], match["plural"], match["ns"], match["name"]) if match else None
            with fake.lock:
                found = fake.objects.pop(key, None) if key else None
                if found is not None:
                    fake._delete_owned(found["metadata"].get("namespace", ""), found["metadata"].get("uid", ""))
                if found is not None and found.get("kind") == "Deployment":
                    fake.history.append(fake.servers())
                    fake._note_ready()
            if found is None:
                return self._send(404, _status(404, f"{path} not found"))
            return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        def do_POST(self) -> None:
            path, _, raw = self._route()
            if path == "/apis/authorization.k8s.io/v1/subjectaccessreviews":
                review = json.loads(raw)
                with fake.lock:
                    allowed = fake.authorize(review.get("spec") or {})
                return self._send(201, {**review, "status": {"allowed": allowed}})
            match = OBJECT_PATH.match(path)
            if self._proxied(match, raw):
                return None
            if match and not match["name"] and match["plural"] == "leases":
                body = json.loads(raw)
                key = (match["gv"], "leases", match["ns"], body["metadata"]["name"])
                return self._send(*fake.create(key, body))
            return self._send(404, _status(404, f"no route {path}"))

        def do_PUT(self) -> None:
            path, _, raw = self._route()
            match = OBJECT_PATH.match(path)
            if not match or not match["name"] or match["sub"] or match["plural"] != "leases":
                return self._send(404, _status(404, f"no route {path}"))
            return self._send(*fake.replace((match["gv"], "leases", match["ns"], match["name"]), json.loads(raw)))

        def _proxied(self, match, raw: bytes) -> bool:
            """Answer a request under a Service's /proxy/; False when it is not one."""
            if not (
                match and match["plural"] == "services" and match["name"] and (match["sub"] or "").startswith("/proxy/")
            ):
                return False
            service = match["name"].split(":", 1)[0]
            query = urlsplit(self.path).query
            rest = match["sub"][len("/proxy") :] + (f"?{query}" if query else "")
            self._send(*fake.proxy(match["ns"], service, self.command, rest, raw))
            return True

    return Handler


def _forward(method: str, url: str, raw: bytes) -> tuple[int, dict]:
    """The engine's answer to one proxied request, its status kept."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url, data=raw if method == "POST" else None, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def plural_of(kind: str) -> str:
    """A kind's resource name, as the API server's REST mapper lowercases and pluralises it."""
    lower = kind.lower()
    return lower + ("es" if lower.endswith("s") else "s")


def dead_url() -> str:
    """An address where nothing listens (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakePrometheus:
    """The cluster's Prometheus as the rollout's analysis asks it (`/api/v1/query`), answering from
    the fake cluster itself: engines up = a release's ready pods, finished requests = the client
    requests through the Gateway its pods answered, and the p90 TTFT / TPOT each release's engines
    report (`ttft_s`, `tpot_s`: release -> seconds, what their histograms would give). Every query
    asked is kept in `asked`."""

    def __init__(self, cluster: FakeCluster, ttft_s: dict[str, float], tpot_s: dict[str, float] | None = None):
        self.cluster, self.ttft_s, self.tpot_s = cluster, ttft_s, tpot_s or {}
        self.asked: list[str] = []
        self.at: list[str | None] = []  # each query's evaluation time (`time=`), as asked
        self.failing = 0  # the next this many queries answer HTTP 503 (a Prometheus restarting, overloaded)
        self.errors = 0  # how many queries were answered with an error
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _prometheus_handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FakePrometheus:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def value(self, promql: str) -> float | None:
        self.asked.append(promql)
        release = (re.search(r'release="([^"]*)"', promql) or [None, ""])[1]
        if 'finished_reason=~"abort|error"' in promql or 'status=~"5.."' in promql or "== 0" in promql:
            return 0.0  # no aborts, no 5xx, no engine down
        if promql.startswith("ceil(sum(rate(vllm:request_success_total"):  # the KEDA scalers' query
            return self.cluster.wanted(promql)
        if promql.startswith("count(up{"):
            return float(self.cluster.ready_pods().get(release, 0))
        if "vllm:request_success_total" in promql:
            return float(sum(1 for h in list(self.cluster.hits) if h.release == release and h.status == 200))
        if "vllm:time_to_first_token_seconds_bucket" in promql:
            return self.ttft_s.get(release)
        if "vllm:request_time_per_output_token_seconds_bucket" in promql:
            return self.tpot_s.get(release, 0.02)
        raise AssertionError(f"the fake Prometheus does not know {promql}")


def _prometheus_handler(prometheus: FakePrometheus):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            asked = parse_qs(urlsplit(self.path).query)
            promql = asked["query"][0]
            prometheus.at.append(asked.get("time", [None])[0])
            if prometheus.failing > 0:
                prometheus.failing -= 1
                prometheus.errors += 1
                data = json.dumps({"status": "error", "errorType": "unavailable", "error": "overloaded"}).encode()
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            value = prometheus.value(promql)
            result = [] if value is None else [{"metric": {}, "value": [time.time(), str(value)]}]
            data = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
