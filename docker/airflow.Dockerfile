# Airflow with this project's DAGs, plugins and `pipeline` package: api-server, scheduler,
# dag-processor, triggerer and (LocalExecutor) workers. Heavy stages run elsewhere as pods
# (execution: kubernetes), so this image carries no GPU stack and no torch.
ARG AIRFLOW_VERSION=3.3.2
FROM apache/airflow:${AIRFLOW_VERSION}-python3.11

USER airflow
COPY --chown=airflow:root pyproject.toml /opt/model-release/
COPY --chown=airflow:root pipeline /opt/model-release/pipeline
RUN pip install --no-cache-dir \
      "apache-airflow==${AIRFLOW_VERSION}" \
      apache-airflow-providers-standard apache-airflow-providers-cncf-kubernetes apache-airflow-providers-amazon \
      boto3 pydantic pyyaml matplotlib kubernetes \
 && pip install --no-cache-dir --no-deps /opt/model-release
COPY --chown=airflow:root dags /opt/airflow/dags
COPY --chown=airflow:root plugins /opt/airflow/plugins
COPY --chown=airflow:root configs /opt/model-release/configs
ENV MODEL_RELEASE_HOME=/opt/airflow/model-release
