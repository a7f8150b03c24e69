"""The "Model releases" plugin app: Airflow auth on every route, read-only.

The real API server (with the plugin mounted and real JWTs) is exercised in test_e2e.py; this
checks the app itself, fast, without a running Airflow.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from pipeline.airflow.plugin_app import create_app


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
