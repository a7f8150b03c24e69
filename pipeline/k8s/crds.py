"""Custom resources checked against their projects' own CRD schemas, vendored under `schemas/`:
the Kubernetes OpenAPI schema (kubernetes-validate) knows only the built-in kinds, and an API
server without the CRD's schema would reject nothing before the apply."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).parent / "schemas"
# (apiVersion, kind) -> the vendored CRD and where it came from
VENDORED = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",  # prometheus-operator v0.93.0
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",  # gateway-api v1.6.1
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.networking.k8s.io_gateways.yaml",  # gateway-api v1.6.1
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",  # KEDA v2.20.2, config/crd/bases/
}


def known(obj: dict[str, Any]) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in VENDORED


@cache
def definition(api_version: str, kind: str) -> dict[str, Any]:
    """The vendored CustomResourceDefinition itself, as the cluster holds it (its served versions, names)."""
    return yaml.safe_load((SCHEMAS / VENDORED[(api_version, kind)]).read_text())


@cache
def _schema(api_version: str, kind: str) -> dict[str, Any]:
    crd = definition(api_version, kind)
    version = api_version.rsplit("/", 1)[-1]
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def problems(obj: dict[str, Any]) -> list[str]:
    """Problems of one custom resource against its CRD schema; one line each, empty when valid."""
    import jsonschema

    validator = jsonschema.Draft7Validator(_schema(obj["apiVersion"], obj["kind"]))
    where = f"{obj['kind']}/{(obj.get('metadata') or {}).get('name', '?')}"
    return [
        f"{where}: {'.'.join(str(p) for p in error.absolute_path) or '(top level)'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
