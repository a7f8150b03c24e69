"""The "Model releases" plugin app: Airflow auth on every route, read-only.

The real API server (with the plugin mounted and real JWTs) is exercised in test_e2e.py; this
checks the app itself, fast, without a running Airflow.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from pipeline.airflow.plugin_app import create_app
from pipeline.records.events import detail_of


def test_anonymous_requests_are_refused_on_every_route():
    client = TestClient(create_app())
    for path in ("/", "/api/releases", "/releases/1", "/releases/1/audit"):
        response = client.get(path)
        assert response.status_code == 401, (path, response.status_code)
        assert "Not authenticated" in response.text


def test_the_app_only_reads():
    app = create_app()
    methods = {m for route in app.routes if getattr(route, "include_in_schema", False) for m in route.methods}
    assert methods <= {"GET", "HEAD"}, methods
    assert TestClient(app).post("/").status_code in (401, 405)


def test_plugin_registers_the_app_and_a_nav_entry():
    import importlib.util

    from pipeline.core.paths import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location("model_releases", PROJECT_ROOT / "plugins" / "model_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = module.ModelReleasesPlugin
    assert plugin.fastapi_apps[0]["url_prefix"] == "/model-releases"
    assert plugin.external_views[0]["destination"] == "nav" and plugin.external_views[0]["href"] == "model-releases/"


def test_the_pages_render_through_the_autoescaped_templates(tmp_path):
    """A release's name or an event's actor is text on the pages, never markup."""
    from pipeline.airflow.plugin_app import _audit_html, releases_page
    from pipeline.release.registry import Registry

    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    rel = reg.open_release("run-a", "<script>alert(1)</script>", "x.yaml", "", "local")
    reg.record(rel.id, detail_of("approved", {"comment": "<i>ok</i>"}), "<b>reviewer</b>")
    page = releases_page(reg)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "approved by &lt;b&gt;reviewer&lt;/b&gt;" in page and f'href="releases/{rel.id}/audit"' in page
    audit = _audit_html(reg, rel.id)
    assert "<i>" not in audit and "&lt;i&gt;ok&lt;/i&gt;" in audit and "<title>Release 1: audit trail</title>" in audit
