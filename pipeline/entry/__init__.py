"""The entry layer: the task functions the DAGs and step pods call. The library below never imports it.

Importing it installs Airflow as the platform the library reads connections and sends alerts
through (`pipeline.core.platform`): every way in (a DAG task, a pod, the CLI) passes here.
"""

from pipeline.core import platform
from pipeline.entry.airflow_platform import AirflowPlatform

platform.use(AirflowPlatform())
