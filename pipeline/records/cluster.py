"""What the cluster preflight hands on: the checks that passed (a failure fails the task instead)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["ClusterReady"]


class ClusterReady(BaseModel):
    """The cluster holds what the release needs, as `pipeline.k8s.preflight` found it."""

    passed: list[str] = Field(description="the checks that passed, by name (api, namespaces, access, gateway, ...)")
    servers_at_once: int = Field(description="the servers the rollout may run at once that the GPUs were checked for")
