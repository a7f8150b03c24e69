"""How the cluster's Prometheus scrapes the serving pods, so a rollout's PromQL finds them.

The analysis (`release/analysis.py`) selects each release's engines by a `release` label. On the
cluster that label comes from the pod's `model-release/release-id` label, copied at scrape time by
a relabeling rule; without it every series lacks `release`, every step waits for metrics, times
out and rolls back. Two equivalent ways to ship the rule, rendered from one list of rules:

- a `PodMonitor` (monitoring.coreos.com/v1) for the Prometheus Operator, as kube-prometheus-stack
  (DigitalOcean's 1-Click monitoring stack) runs it. The chart's Prometheus picks up only monitors
  labelled `release: <the chart's Helm release>` unless its value
  `prometheus.prometheusSpec.podMonitorSelectorNilUsesHelmValues` is `false`; `selector_labels`
  carries that label (default: the 1-Click install's release name, `kube-prometheus-stack`).
- a plain `scrape_config` with `kubernetes_sd_configs` (role: pod) for a Prometheus without the
  operator: the selection the operator derives from the PodMonitor (namespace, pod labels, port,
  running pods) as `keep` / `drop` rules, then the same mapping rules.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from pipeline.core.specs import LoadedSpec, ReleaseSpec
from pipeline.k8s import crds
from pipeline.k8s.manifests import FIELD_PREFIX, RELEASE_LABEL, dns_name, instance_labels

# the default podMonitorSelector of kube-prometheus-stack: its own Helm release's name
CHART_SELECTOR = {"release": "kube-prometheus-stack"}
METRICS_PORT = "http"  # the engine container's port name (manifests._deployment), /metrics on it


def meta_label(pod_label: str) -> str:
    """The service-discovery label Prometheus gives a pod label: `__meta_kubernetes_pod_label_`
    and the name with every character outside [a-zA-Z0-9_] replaced by `_` (Prometheus'
    strutil.SanitizeLabelName)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def mapping_rules() -> list[dict[str, Any]]:
    """The pod's labels to the series' labels the analysis selects on (`release`, `layout`, `pod`),
    in Prometheus' `relabel_configs` spelling."""
    return [
        {"source_labels": [meta_label(RELEASE_LABEL)], "target_label": "release", "action": "replace"},
        {"source_labels": [meta_label(f"{FIELD_PREFIX}/layout")], "target_label": "layout", "action": "replace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod", "action": "replace"},
    ]


def selection_rules(spec: ReleaseSpec) -> list[dict[str, Any]]:
    """What the operator derives from a PodMonitor's selector, namespace and port, for a plain
    scrape config: this model's serving pods in the spec's namespace, their metrics port, running."""
    keep = [
        (["__meta_kubernetes_namespace"], spec.promotion.namespace),
        *(([meta_label(k)], v) for k, v in instance_labels(spec).items()),
        (["__meta_kubernetes_pod_container_port_name"], METRICS_PORT),
    ]
    return [
        *({"source_labels": labels, "regex": re.escape(value), "action": "keep"} for labels, value in keep),
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace", "action": "replace"},
    ]


def _camel(rule: dict[str, Any]) -> dict[str, Any]:
    """A `relabel_configs` rule in the Prometheus Operator's RelabelConfig spelling."""
    return {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key): value for key, value in rule.items()}


def pod_monitor(loaded: LoadedSpec, selector_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The PodMonitor for every release of the spec's model (one object; releases come and go)."""
    spec = loaded.spec
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {
            "name": dns_name(spec.name),
            "namespace": spec.promotion.namespace,
            "labels": {**instance_labels(spec), **(CHART_SELECTOR if selector_labels is None else selector_labels)},
        },
        "spec": {
            "selector": {"matchLabels": instance_labels(spec)},
            "namespaceSelector": {"matchNames": [spec.promotion.namespace]},
            "podMetricsEndpoints": [
                {
                    "port": METRICS_PORT,
                    "path": "/metrics",
                    "interval": spec.rollout.scrape_interval,
                    "relabelings": [_camel(rule) for rule in mapping_rules()],
                }
            ],
        },
    }


def scrape_config(loaded: LoadedSpec) -> dict[str, Any]:
    """The same scrape as a plain Prometheus `scrape_configs` entry (Kubernetes pod discovery)."""
    spec = loaded.spec
    return {
        "job_name": f"model-release/{dns_name(spec.name)}",
        "scrape_interval": spec.rollout.scrape_interval,
        "metrics_path": "/metrics",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [spec.promotion.namespace]}}],
        "relabel_configs": [*selection_rules(spec), *mapping_rules()],
    }


def validate_pod_monitor(obj: dict[str, Any]) -> list[str]:
    """Problems against the Prometheus Operator's own CRD schema (vendored from prometheus-operator
    v0.93.0, example/prometheus-operator-crd/); one line each, empty when valid."""
    return crds.problems(obj)


def to_yaml(loaded: LoadedSpec) -> str:
    """Both, for `model-release manifests --monitoring`: apply the first, or paste the second."""
    scrape = yaml.safe_dump({"scrape_configs": [scrape_config(loaded)]}, sort_keys=False)
    return (
        "# For the Prometheus Operator (kube-prometheus-stack): apply once per model\n"
        + yaml.safe_dump(pod_monitor(loaded), sort_keys=False)
        + "---\n# The same scrape for a Prometheus without the operator (its prometheus.yml):\n"
        + "\n".join(f"# {line}" for line in scrape.splitlines())
        + "\n"
    )
