-- The release registry lives beside Airflow's metadata, in its own database on the same server
-- (MODEL_RELEASE_REGISTRY_URL in compose.yaml). Postgres runs this once, when the data volume is new.
CREATE DATABASE model_release OWNER airflow;
