"""The scheduler signal's settings (``python -m phalanx.services.scheduler_signal``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from phalanx.settings.common import PLAIN_NAME, ServiceSettings


class SchedulerSignalSettings(ServiceSettings):
    """Which cluster sources it watches: the local cluster, a simulated cluster file, Kubernetes."""

    local_cluster: bool = Field(
        default=True, description="Watch the local cluster (`phalanx cluster offer`)."
    )
    cluster_file: Path | None = Field(default=None, description="A JSON file describing a simulated cluster.")
    cluster_poll_s: float = Field(default=0.5, gt=0, description="How often cluster_file is read.")
    cluster_name: str = Field(
        default="k8s", pattern=PLAIN_NAME, description="The Kubernetes cluster's name in signals."
    )
    k8s: bool = Field(default=False, description="Watch the Kubernetes API also outside a pod.")
    k8s_api: str | None = Field(
        default=None, description="The Kubernetes API server (e.g. kubectl proxy's URL)."
    )
    k8s_namespace: str | None = Field(
        default=None, description="The job's namespace (default: the pod's, else default)."
    )
    k8s_pod_selector: str = Field(default="phalanx.io/job", description="Label selector of the job's pods.")
    k8s_node_selector: str = Field(default="", description="Label selector of the nodes whose slots count.")
    k8s_slot_resource: str = Field(
        default="nvidia.com/gpu", description="The allocatable resource that counts as slots."
    )
    k8s_health_label: str = Field(
        default="phalanx.io/unhealthy", description="Node label that marks a node unhealthy."
    )
    k8s_all_namespaces: bool = Field(default=False, description="Watch pending pods of every namespace.")
