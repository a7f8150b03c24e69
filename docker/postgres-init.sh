#!/bin/sh
# The release registry lives beside Airflow's metadata, in its own database on the same server,
# with its own roles: model_release_owner owns it and runs the migrations (the registry-migrate
# service); the pipeline logs in as model_release_app, a member of model_release_runtime, which the
# migrations let read, append and change a release's status and facts, never edit an event.
# Postgres runs this once, when the data volume is new; the passwords come from the environment.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
  -v owner_password="$MODEL_RELEASE_OWNER_PASSWORD" -v app_password="$MODEL_RELEASE_APP_PASSWORD" <<'SQL'
CREATE ROLE model_release_owner LOGIN PASSWORD :'owner_password';
CREATE ROLE model_release_runtime NOLOGIN;
CREATE ROLE model_release_app LOGIN PASSWORD :'app_password' IN ROLE model_release_runtime;
CREATE DATABASE model_release OWNER model_release_owner;
SQL
