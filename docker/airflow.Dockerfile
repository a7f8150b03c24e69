# Airflow with this project's DAGs, plugins and `pipeline` package: api-server, scheduler,
# dag-processor, triggerer and workers (LocalExecutor in compose, KubernetesExecutor on DOKS).
# Heavy stages run elsewhere as pods (execution: kubernetes), so this image carries no GPU stack
# and no torch; it installs the `airflow` extra (pyproject.toml): the light tasks, promotion with
# its manifest validation and served-answers check (lm-eval's local-completions), the registry on
# Postgres. docker/images.sh builds it FROM the digest recorded in docker/base/airflow.txt.
ARG AIRFLOW_VERSION=3.3.2
ARG AIRFLOW_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python3.11
FROM ${AIRFLOW_IMAGE}
ARG EXTRA=airflow
ARG BASE_FREEZE=docker/base/airflow.txt

USER root
RUN mkdir -p /opt/model-release && chown airflow:root /opt/model-release
USER airflow
WORKDIR /opt/model-release
COPY --chown=airflow:root docker/check-base.sh /opt/model-release/docker/
COPY --chown=airflow:root docker/base/airflow.txt /opt/model-release/docker/base/
RUN sh docker/check-base.sh "${BASE_FREEZE}"
COPY --chown=airflow:root pyproject.toml /opt/model-release/
COPY --chown=airflow:root pipeline /opt/model-release/pipeline
COPY --chown=airflow:root configs /opt/model-release/configs
# The one list: the extra, with the base's packages (Airflow and its providers) held as they are.
# Editable install: `pipeline` finds configs/ next to itself (pipeline.core.paths.CONFIGS_DIR).
RUN pip install --no-cache-dir --constraint "${BASE_FREEZE}" --editable "/opt/model-release[${EXTRA}]"
COPY --chown=airflow:root dags /opt/airflow/dags
COPY --chown=airflow:root plugins /opt/airflow/plugins
ENV MODEL_RELEASE_HOME=/opt/airflow/model-release
