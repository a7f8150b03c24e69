"""Airflow integration: the approval operator, review tasks, the plugin's pages, the REST client."""
