"""Airflow plugin "Model releases": the registry's releases, reports and audit trails in the UI.

Thin on purpose: the pages live in `pipeline.airflow.plugin_app` (authenticated, read-only).
"""

from airflow.plugins_manager import AirflowPlugin

from pipeline.airflow.plugin_app import create_app


class ModelReleasesPlugin(AirflowPlugin):
    name = "model_releases"
    fastapi_apps = [{"app": create_app(), "url_prefix": "/model-releases", "name": "Model releases"}]
    external_views = [
        {
            "name": "Model releases",
            "href": "model-releases/",
            "destination": "nav",
            "url_route": "model-releases",
            "category": "browse",
        }
    ]
