# Airflow with this project's DAGs, plugins and `pipeline` package: api-server, scheduler,
# dag-processor, triggerer and workers (LocalExecutor in compose, KubernetesExecutor on DOKS).
# Heavy stages run elsewhere as pods (execution: kubernetes), so this image carries no GPU
# stack and no torch; the light tasks (gates, layout selection) need great-expectations.
# Build and push with docker/images.sh, which tags it with the package version.
ARG AIRFLOW_VERSION=3.3.2
FROM apache/airflow:${AIRFLOW_VERSION}-python3.11

USER root
RUN mkdir -p /opt/model-release && chown airflow:root /opt/model-release
USER airflow
COPY --chown=airflow:root pyproject.toml /opt/model-release/
COPY --chown=airflow:root requirements/main.lock /opt/model-release/requirements/main.lock
COPY --chown=airflow:root pipeline /opt/model-release/pipeline
COPY --chown=airflow:root configs /opt/model-release/configs
# great-expectations' API moves between minors: take the version the project is locked to.
# Editable install: `pipeline` finds configs/ next to itself (pipeline.core.paths.CONFIGS_DIR).
RUN grep -E '^great_expectations==' /opt/model-release/requirements/main.lock > /tmp/pins.txt \
 && pip install --no-cache-dir --constraint /tmp/pins.txt \
      "apache-airflow==${AIRFLOW_VERSION}" \
      apache-airflow-providers-standard apache-airflow-providers-cncf-kubernetes apache-airflow-providers-amazon \
      boto3 pydantic pyyaml matplotlib kubernetes great_expectations \
 && pip install --no-cache-dir --no-deps --editable /opt/model-release
COPY --chown=airflow:root dags /opt/airflow/dags
COPY --chown=airflow:root plugins /opt/airflow/plugins
ENV MODEL_RELEASE_HOME=/opt/airflow/model-release
