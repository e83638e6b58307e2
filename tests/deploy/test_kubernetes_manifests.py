"""The manifests in deploy/kubernetes/ fit together: names, labels, ports, probes and settings.

No cluster runs here, so the structure is checked: what each object needs for the API server to
accept it, and the references between objects that would otherwise fail only at run time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from _compose import dockerfile

from ringserve.config import CoordinatorConfig, WorkerConfig

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def load_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    objects = []
    for name in kustomization["resources"]:
        objects += [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]
    return objects


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for obj in load_objects():
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in found, f"{key} is defined twice"
        found[key] = obj
    return found


def one(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    matches = [obj for (k, _), obj in objects.items() if k == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    assert isinstance(containers[0], dict)
    return containers[0]


def config_data(objects: dict[tuple[str, str], dict[str, Any]], workload: dict[str, Any]) -> dict[str, str]:
    """The environment a workload's container gets from its ConfigMaps (every one must exist)."""
    data: dict[str, str] = {}
    for source in container(workload).get("envFrom", []):
        if "configMapRef" not in source:
            continue
        name = source["configMapRef"]["name"]
        assert ("ConfigMap", name) in objects, f"ConfigMap {name} is referenced but not defined"
        data.update(objects[("ConfigMap", name)]["data"])
    return data


def test_every_file_in_the_folder_is_listed_in_the_kustomization() -> None:
    listed = set(yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_every_object_has_an_api_version_a_kind_and_a_dns_safe_name(objects: dict) -> None:
    expected = {"ConfigMap": "v1", "Service": "v1", "Deployment": "apps/v1", "Job": "batch/v1", "StatefulSet": "apps/v1"}
    for (kind, name), obj in objects.items():
        assert obj["apiVersion"] == expected[kind], (kind, name)
        assert name.replace("-", "").isalnum() and name == name.lower() and len(name) <= 63


def test_config_map_values_are_strings_read_by_the_configs(objects: dict) -> None:
    data = one(objects, "ConfigMap")["data"]
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
    # Both roles parse the same settings without error.
    CoordinatorConfig.from_env(data)
    WorkerConfig.from_env(data)


def test_the_coordinator_is_one_replica_whose_selector_matches_its_pods(objects: dict) -> None:
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "two coordinators would split the world"
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert container(deployment)["command"] == ["ringserve", "coordinator"]


def test_the_service_selects_the_coordinator_pods_and_targets_its_grpc_port(objects: dict) -> None:
    service, deployment = one(objects, "Service"), one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    worker_labels = workers(objects)["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker_labels.items(), "the Service would select workers"
    (port,) = service["spec"]["ports"]
    (container_port,) = container(deployment)["ports"]
    assert port["targetPort"] in (container_port["name"], container_port["containerPort"])
    listen = CoordinatorConfig.from_env(config_data(objects, deployment))
    assert container_port["containerPort"] == listen.port
    assert listen.host == "0.0.0.0"


def test_the_coordinator_has_grpc_readiness_and_liveness_probes_on_its_port(objects: dict) -> None:
    deployment = one(objects, "Deployment")
    port = CoordinatorConfig.from_env(config_data(objects, deployment)).port
    for probe in ("readinessProbe", "livenessProbe"):
        check = container(deployment)[probe]
        assert set(check) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert check["grpc"]["port"] == port
        # "" (the default) and ringserve.v1.Coordinator are the names the health service knows.
        assert check["grpc"].get("service", "") in ("", "ringserve.v1.Coordinator")


def workers(objects: dict) -> dict[str, Any]:
    found = [obj for (kind, _), obj in objects.items() if kind in ("Job", "StatefulSet")]
    assert len(found) == 1
    return found[0]


def test_workers_are_an_indexed_job_whose_size_matches_the_first_view(objects: dict) -> None:
    job = workers(objects)
    assert job["kind"] == "Job"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    settings = CoordinatorConfig.from_env(config_data(objects, one(objects, "Deployment")))
    # All pods run at once and form one view of exactly that size.
    assert settings.min_workers == spec["parallelism"] == settings.max_workers
    assert pod_spec(job)["restartPolicy"] in ("Never", "OnFailure")


def test_workers_dial_the_coordinator_service_by_name(objects: dict) -> None:
    job, service = workers(objects), one(objects, "Service")
    worker = WorkerConfig.from_env(config_data(objects, job))
    host, _, port = worker.coordinator.rpartition(":")
    assert host == service["metadata"]["name"]
    assert int(port) == service["spec"]["ports"][0]["port"]


def test_each_worker_advertises_its_pod_ip_and_takes_its_completion_index_as_rank_hint(objects: dict) -> None:
    job = workers(objects)
    env = {e["name"]: e for e in container(job)["env"]}
    assert env["RINGSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["RINGSERVE_RANK_HINT"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    assert WorkerConfig.from_env(config_data(objects, job)).bind_host == "0.0.0.0"


def test_workers_wait_for_the_coordinator_health_before_training(objects: dict) -> None:
    (init,) = pod_spec(workers(objects))["initContainers"]
    script = " ".join(init["command"])
    assert "ringserve.healthcheck" in script and "$RINGSERVE_COORDINATOR" in script
    assert init["image"] == container(workers(objects))["image"]


def test_the_worker_command_is_the_demo_in_the_image(objects: dict) -> None:
    argv = container(workers(objects))["command"]
    assert argv[0] == "python" and argv[1] == "examples/train_digits.py"
    assert (ROOT / argv[1]).is_file()


def test_every_pod_runs_as_the_images_non_root_user(objects: dict) -> None:
    for workload in (one(objects, "Deployment"), workers(objects)):
        security = pod_spec(workload)["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["runAsUser"] == int(dockerfile().user.split(":")[0]), "the Dockerfile's user"
        images = {c["image"] for c in pod_spec(workload)["containers"] + pod_spec(workload).get("initContainers", [])}
        assert images == {"ringserve"}, "the kustomization's images entry sets the tag"


def test_workers_pin_the_payload_lanes_port_and_name_it_on_the_container(objects: dict) -> None:
    job = workers(objects)
    worker = WorkerConfig.from_env(config_data(objects, job))
    assert worker.payload_port != 0 and worker.payload_lane == "auto"
    ports = {p["name"]: p["containerPort"] for p in container(job)["ports"]}
    assert ports == {"payload": worker.payload_port}


def test_every_pod_takes_the_jobs_token_from_a_secret_it_cannot_start_without(objects: dict) -> None:
    # Secure by default (docs/deploy/kubernetes.md): the Secret is the user's to make; a missing one
    # keeps every pod from starting (CreateContainerConfigError) rather than letting it run open.
    for kind in ("Deployment", "Job"):
        spec = pod_spec(one(objects, kind))
        for box in spec.get("initContainers", []) + spec["containers"]:
            refs = [s["secretRef"] for s in box.get("envFrom", []) if "secretRef" in s]
            assert refs == [{"name": "ringserve-token"}], (kind, box["name"])
    for (kind, _), obj in objects.items():
        assert kind != "Secret", "a token committed to the repository would be every job's"
        assert "RINGSERVE_INSECURE" not in obj.get("data", {})
