"""docker-compose.yml and the Dockerfile hold what ``docker compose up --scale worker=N`` needs.

No Docker engine runs here, so these tests read the files as compose and Docker would; the
neighbouring test_compose_services.py runs the services' commands as local processes.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from _compose import COMPOSE_FILE, ROOT, command, dockerfile, environment, image_path, load, load_raw, variables

from ringserve.config import ADVERTISE_AUTO, CoordinatorConfig, ShardConfig, WorkerConfig

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def services() -> dict:
    return load({})["services"]


def test_the_file_has_a_coordinator_service_and_a_worker_service(services: dict) -> None:
    assert set(services) == {"coordinator", "worker", "ps"}


def test_the_parameter_server_shards_start_only_with_the_ps_profile(services: dict) -> None:
    assert services["ps"]["profiles"] == ["ps"]
    assert "profiles" not in services["coordinator"] and "profiles" not in services["worker"]


@pytest.mark.parametrize("name", ["coordinator", "worker", "ps"])
def test_no_service_pins_a_container_name_a_host_port_or_an_address(services: dict, name: str) -> None:
    service = services[name]
    assert "container_name" not in service, "a fixed container name allows only one replica"
    assert "hostname" not in service, "replicas would share one hostname"
    assert service.get("network_mode") != "host", "replicas on the host network would share ports"
    for port in service.get("ports", []):
        assert not _published_host_port(port), f"{name} publishes a fixed host port: {port!r}"
    networks = service.get("networks")
    for network in networks.values() if isinstance(networks, dict) else []:
        assert not (network or {}).get("ipv4_address"), f"{name} pins an IP address"


def _published_host_port(port: object) -> str:
    """The fixed host port of a compose port entry ("8080:50051", {"published": 8080}), or ""."""
    if isinstance(port, dict):
        return str(port.get("published") or "")
    parts = str(port).split(":")  # "50051", "8080:50051", "127.0.0.1:8080:50051", "127.0.0.1::50051"
    return parts[-2] if len(parts) >= 2 else ""


def test_workers_find_the_coordinator_by_its_service_name_and_port(services: dict) -> None:
    coordinator = CoordinatorConfig.from_env(environment(services["coordinator"]))
    worker = WorkerConfig.from_env(environment(services["worker"]))
    host, _, port = worker.coordinator.rpartition(":")
    assert host == "coordinator"
    assert int(port) == coordinator.port != 0


def test_the_coordinator_listens_on_every_interface_of_its_container(services: dict) -> None:
    assert CoordinatorConfig.from_env(environment(services["coordinator"])).host == "0.0.0.0"


def test_workers_listen_on_every_interface_and_advertise_their_own_container_address(services: dict) -> None:
    worker = WorkerConfig.from_env(environment(services["worker"]))
    assert worker.bind_host == "0.0.0.0"
    # A fixed advertised address would be the same for every replica; "auto" is resolved in each
    # container to its own address on the route to the coordinator.
    assert worker.advertise_host == ADVERTISE_AUTO


def test_every_ringserve_variable_is_a_setting_of_the_service_that_sets_it(services: dict) -> None:
    roles = {"coordinator": CoordinatorConfig, "worker": WorkerConfig, "ps": ShardConfig}
    for name, config in roles.items():
        known = {f"RINGSERVE_{f.name.upper()}" for f in dataclasses.fields(config)}
        unknown = {k for k in environment(services[name]) if k.startswith("RINGSERVE_")} - known
        assert not unknown, f"{name} sets variables that {config.__name__}.from_env never reads: {unknown}"


@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_the_first_view_can_form_with_any_scale(services: dict, scale: int) -> None:
    coordinator = CoordinatorConfig.from_env(environment(services["coordinator"]))
    assert coordinator.min_workers <= scale <= coordinator.max_workers
    # Replicas start a little apart: the settle window lets them land in one view.
    assert coordinator.settle_s >= 2


def test_the_coordinator_health_check_speaks_the_grpc_health_protocol_on_its_port(services: dict) -> None:
    coordinator = services["coordinator"]
    port = CoordinatorConfig.from_env(environment(coordinator)).port
    test = coordinator["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert test[1:4] == ["python", "-m", "ringserve.healthcheck"]
    assert test[4] == f"127.0.0.1:{port}"
    assert test[test.index("--service") + 1] == "ringserve.v1.Coordinator"


def test_workers_start_only_once_the_coordinator_is_healthy(services: dict) -> None:
    assert services["worker"]["depends_on"] == {"coordinator": {"condition": "service_healthy"}}


def test_workers_share_a_tmpfs_volume_at_the_shared_dir_for_their_rings(services: dict) -> None:
    worker = WorkerConfig.from_env(environment(services["worker"]))
    assert worker.shared_dir and worker.shared_memory
    assert f"rings:{worker.shared_dir}" in services["worker"]["volumes"]
    volume = load_raw()["volumes"]["rings"]["driver_opts"]
    assert volume["type"] == volume["device"] == "tmpfs"
    user = dockerfile().user.split(":")[0]
    assert f"uid={user}" in volume["o"], "the image's user must own the volume to make its sockets there"
    assert not [m for m in services["coordinator"].get("volumes", []) if m.startswith("rings:")]


def test_the_job_is_secure_by_default_the_coordinator_makes_the_token_every_other_service_reads(services: dict) -> None:
    argv = command(services["coordinator"]["command"])
    made = argv[argv.index("--make-token") + 1]
    folder = made.rsplit("/", 1)[0]
    assert f"token:{folder}" in services["coordinator"]["volumes"]
    for name in ("worker", "ps"):
        env = environment(services[name])
        assert env["RINGSERVE_TOKEN_FILE"] == made, name
        assert f"token:{folder}:ro" in services[name]["volumes"], name  # read-only where it is read
    volume = load_raw()["volumes"]["token"]["driver_opts"]
    assert volume["type"] == "tmpfs" and "mode=0700" in volume["o"]  # never on disk, the image's user only
    # Nothing turns it off by default.
    assert not any("RINGSERVE_INSECURE" in environment(s) for s in services.values())


def test_finished_workers_are_not_restarted(services: dict) -> None:
    assert services["worker"].get("restart", "no") in ("no", "on-failure")


def test_both_services_run_the_one_image_built_from_the_dockerfile(services: dict) -> None:
    images = {services[name].get("image") for name in services}
    builds = {services[name]["build"]["context"] for name in services}
    assert len(images) == 1 and builds == {"."}
    assert (ROOT / services["worker"]["build"]["dockerfile"]).is_file()


COMPOSE_DOC = ROOT / "docs" / "deploy" / "compose.md"


def test_every_setting_has_a_default_and_is_documented_in_the_compose_page() -> None:
    page = COMPOSE_DOC.read_text()
    for name, default in variables(load_raw()):
        assert default, f"${{{name}}} has no default in {COMPOSE_FILE.name}"
        assert name in page, f"{name} is not documented in {COMPOSE_DOC.relative_to(ROOT)}"


def test_settings_come_from_the_shell_environment() -> None:
    services = load({"RINGSERVE_PORT": "6000", "RINGSERVE_MIN_WORKERS": "8", "DEMO_EPOCHS": "3"})["services"]
    assert environment(services["coordinator"])["RINGSERVE_PORT"] == "6000"
    assert environment(services["coordinator"])["RINGSERVE_MIN_WORKERS"] == "8"
    assert environment(services["worker"])["RINGSERVE_COORDINATOR"] == "coordinator:6000"
    worker_command = services["worker"]["command"]
    assert worker_command[worker_command.index("--epochs") + 1] == "3"
    assert services["coordinator"]["healthcheck"]["test"][4] == "127.0.0.1:6000"


def test_the_image_holds_what_the_worker_command_runs(services: dict) -> None:
    build = dockerfile()
    script = next(arg for arg in services["worker"]["command"] if arg.endswith(".py"))
    source = image_path(build, script)
    assert source, f"no COPY puts {script} into the image's {build.workdir}"
    assert (ROOT / source).is_file(), f"{source} does not exist"
    assert script == "examples/compose_worker.py"
    # It runs one of two demos, which import the plain demo's model and hash from beside them.
    for demo in ("examples/train_digits_elastic.py", "examples/train_digits_ps.py", "examples/train_digits.py"):
        assert image_path(build, demo), demo


def test_the_dockerfile_builds_a_slim_python_311_image_with_cpu_torch_and_a_non_root_user() -> None:
    build = dockerfile()
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", build.base)
    torch_install = next(run for run in build.runs if "torch==" in run)
    assert "torch==2.13.0" in torch_install and "/whl/cpu" in torch_install
    assert any(re.search(r"pip install \"?\.\[torch[],]", run) for run in build.runs)
    assert build.user and build.user.split(":")[0] not in ("root", "0")


def test_the_build_context_leaves_out_the_virtualenv_and_git() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    for sources, _ in dockerfile().copies:
        for source in sources:
            assert source not in ignored, f"{source} is copied but excluded from the context"


# Compose defaults that differ from the config's on purpose, each with its reason. Any other
# ${RINGSERVE_X:-default} in the file must be the config's own default, so that a container runs
# what `ringserve run` runs (the 1 MiB chunk that the file once held against the config's 2 MiB).
CONTAINER_DEFAULTS = {
    ("coordinator", "RINGSERVE_PORT"): "workers dial the coordinator's service name at a known port",
    ("coordinator", "RINGSERVE_SETTLE_S"): "replicas start seconds apart; a longer window puts them in one view",
    ("worker", "RINGSERVE_PAYLOAD_PORT"): "each container has a port space of its own: one known port to open",
    ("coordinator", "RINGSERVE_HTTP_PORT"): "the compose demo shows its status page; the config serves none by default",
}


def _passthrough_defaults(service: dict) -> dict[str, str]:
    """The service's settings written ``NAME: ${NAME:-default}``: the default compose gives each."""
    found = {}
    for name, value in environment(service).items():
        match = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", value)
        if match and match.group(1) == name:
            found[name] = match.group(2)
    return found


@pytest.mark.parametrize(("name", "config"), [("coordinator", CoordinatorConfig), ("worker", WorkerConfig),
                                              ("ps", ShardConfig)])
def test_the_compose_defaults_are_the_configs_defaults(name: str, config: type) -> None:
    service = load_raw()["services"][name]
    defaults = {k: v for k, v in _passthrough_defaults(service).items() if k.startswith("RINGSERVE_")}
    assert "RINGSERVE_CHUNK_BYTES" in defaults or name != "worker"
    own = config.from_env({})
    checked = 0
    for variable, default in defaults.items():
        field = variable.removeprefix("RINGSERVE_").lower()
        composed = getattr(config.from_env({variable: default}), field)
        if (name, variable) in CONTAINER_DEFAULTS:
            assert composed != getattr(own, field), f"{variable} now matches the config: drop its exception"
            continue
        assert composed == getattr(own, field), (
            f"{name}: {COMPOSE_FILE.name} defaults {variable} to {default!r}, "
            f"{config.__name__} to {getattr(own, field)!r}")
        checked += 1
    assert checked >= (1 if name == "ps" else 3)


def test_each_ps_replica_is_one_shard_that_finds_the_coordinator_and_checkpoints_to_the_shared_volume(
        services: dict) -> None:
    ps = services["ps"]
    shard = ShardConfig.from_env(environment(ps))
    coordinator = CoordinatorConfig.from_env(environment(services["coordinator"]))
    assert ps["command"] == ["ringserve", "ps", "--one-shard"]
    assert shard.coordinator == f"coordinator:{coordinator.port}"
    assert shard.shard_index == -1, "a fixed index would be the same for every replica"
    assert shard.bind_host == "0.0.0.0" and shard.advertise_host == ADVERTISE_AUTO
    assert shard.shards == 2 and shard.bind_port != 0
    assert f"ps-checkpoints:{shard.checkpoint_dir}" in ps["volumes"]
    assert load_raw()["volumes"]["ps-checkpoints"]["driver_opts"]["o"].startswith(f"uid={dockerfile().user.split(':')[0]}")
    assert ps["restart"] == "unless-stopped", "a shard that dies must come back and resume"
    test = ps["healthcheck"]["test"]
    assert test[4] == f"127.0.0.1:{shard.bind_port}"
    assert test[test.index("--service") + 1] == "ringserve.v1.ParameterServer"
    assert ps["depends_on"] == {"coordinator": {"condition": "service_healthy"}}


def test_the_ps_demo_settings_come_from_the_shell_environment() -> None:
    services = load({"PS_SHARDS": "3", "PS_PORT": "7000", "DEMO_PS_MODE": "async"})["services"]
    shard = ShardConfig.from_env(environment(services["ps"]))
    assert (shard.shards, shard.bind_port) == (3, 7000)
    command = services["worker"]["command"]
    assert command[command.index("--ps-mode") + 1] == "async"


def test_the_compose_page_gives_the_compose_files_defaults() -> None:
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", COMPOSE_DOC.read_text(), flags=re.M))
    raw = load_raw()
    for name in ("coordinator", "worker"):
        for variable, default in _passthrough_defaults(raw["services"][name]).items():
            assert documented.get(variable) == default, (
                f"{COMPOSE_DOC.name}'s table gives {variable} as {documented.get(variable)!r}, "
                f"{COMPOSE_FILE.name} as {default!r}")


def test_workers_pin_their_payload_port_and_expose_it(services: dict) -> None:
    worker = WorkerConfig.from_env(environment(services["worker"]))
    assert worker.payload_port == 50052 and worker.payload_lane == "auto"
    assert [str(p) for p in services["worker"]["expose"]] == [str(worker.payload_port)]
