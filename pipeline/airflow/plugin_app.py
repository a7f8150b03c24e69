"""The "Model releases" pages inside Airflow: a read-only FastAPI app the plugin mounts.

Airflow mounts a plugin's FastAPI app without its own login, so every route here depends on
Airflow's auth: the caller's JWT (Authorization header, or the UI's `_token` cookie) is
validated by the API server's auth manager and must grant read access to the `model_release`
DAG. Anonymous requests get 401, bad tokens 403. Only GET routes exist: the registry is
written by the pipeline and the CLI, never through these pages.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse

from pipeline.core.errors import UnknownRelease
from pipeline.core.html import environment
from pipeline.release.registry import Registry, audit_trail, cached

DAG_ID = "model_release"


def _auth_dependency():
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=DAG_ID)


PAGES = environment(Path(__file__).parent / "templates")


def releases_page(reg: Registry) -> str:
    rows = []
    for rel in reg.releases():
        decision = next((e for e in reversed(reg.events(rel.id)) if e.kind in ("approved", "rejected")), None)
        chosen = rel.data.chosen
        rows.append(
            {
                "id": rel.id,
                "name": rel.name,
                "status": rel.status,
                "target": rel.target,
                "layout": rel.data.layout or "—",
                "rate": f"{chosen.rate_per_server:.3g}" if chosen and chosen.rate_per_server is not None else "—",
                "decision": f"{decision.kind} by {decision.actor}" if decision else "—",
                "created": f"{rel.created_at:%Y-%m-%d %H:%M}",
                "report": bool(rel.data.report),
            }
        )
    return PAGES.get_template("releases.html.j2").render(registry=reg.safe_url, rows=rows)


def create_app() -> FastAPI:
    # no /docs or /openapi.json: FastAPI serves those outside the app-level auth dependency
    app = FastAPI(
        title="Model releases",
        dependencies=[Depends(_auth_dependency())],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    def registry() -> Registry:
        return cached()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return await asyncio.to_thread(lambda: releases_page(registry()))

    @app.get("/api/releases")
    async def releases_json() -> JSONResponse:
        rels = await asyncio.to_thread(lambda: registry().releases())
        # the facts as recorded: those no step set are left out, not listed as null
        return JSONResponse([r.model_dump(mode="json", exclude={"spec_yaml"}, exclude_unset=True) for r in rels])

    @app.get("/releases/{release_id}", response_class=HTMLResponse)
    async def report(release_id: int) -> str:
        def load() -> str:
            reg = registry()
            rel = reg.get(release_id)
            path = rel.data.report
            if path and Path(path).exists():
                return Path(path).read_text()
            return _audit_html(reg, release_id)

        return await asyncio.to_thread(_or_404(load))

    @app.get("/releases/{release_id}/audit", response_class=HTMLResponse)
    async def audit(release_id: int) -> str:
        return await asyncio.to_thread(_or_404(lambda: _audit_html(registry(), release_id)))

    return app


def _audit_html(reg: Registry, release_id: int) -> str:
    return PAGES.get_template("audit.html.j2").render(release_id=release_id, trail=audit_trail(reg, release_id))


def _or_404(fn):
    def wrapped():
        try:
            return fn()
        except UnknownRelease as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None

    return wrapped
