"""The embedded harness: a local S3 server, Airflow standalone and the demo, for this machine and CI."""
