"""deploy/compose.yaml: valid against the Compose Specification schema, the README's commands, secrets only from
deploy/.env, and the pieces in the right order (store and schema before the coordinator, the coordinator before
the router job and the islands). No container engine runs here, so `docker compose up` itself is not run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from coordinator.schemas import RunCreate
from modules import flavour, parse_layout
from tests.deploy.helpers import DEPLOY, ROOT, command_path, envvars_of, markdown_commands, parse_dipaco, shell_commands

# The Compose Specification's JSON schema (compose-spec/compose-spec, Apache-2.0; see schemas/README.md).
SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"
COMPOSE = DEPLOY / "compose.yaml"
# README options the stack leaves out on purpose, and why (a new README option fails the test until it is either
# given in compose.yaml or listed here).
LEFT_OUT = {
    # the coordinator is published on 127.0.0.1 only and islands reach it on the compose network; TLS belongs to
    # the proxy or Ingress of a real deployment (docs/DEPLOY.md)
    ("coordinator", "serve"): {"--ssl-certfile", "--ssl-keyfile"},
    ("island", "join"): {"--ca-file"},
}
REQUIRED = re.compile(r"\$\{(\w+):\?[^}]*\}")
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|ACCESS_KEY|DATABASE_URL")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def _env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment with compose's `${VAR...}` interpolation replaced by a stand-in value."""
    env = service.get("environment", {})
    return {k: REQUIRED.sub("x" * 20, str(v)).replace("$$", "$") for k, v in env.items()}


def _commands(service: dict[str, Any]) -> list[list[str]]:
    """A service's command lines: the exec form, or the lines of an `sh -c` script."""
    command = service.get("command") or []
    if command[:1] == ["sh"] and command[1].startswith("-") and "c" in command[1]:
        return shell_commands(command[2].replace("$$", "$"))
    return [[str(word) for word in command]]


def _dipaco_commands(compose: dict[str, Any]) -> list[tuple[str, list[str], dict[str, str]]]:
    return [
        (name, words, _env(service))
        for name, service in compose["services"].items()
        for words in _commands(service)
        if words[:1] == ["dipaco"]
    ]


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_the_schema_check_catches_a_mistake(compose: dict[str, Any]) -> None:
    """The validator really applies the schema: a misspelt key is refused."""
    broken = json.loads(json.dumps(compose))
    broken["services"]["coordinator"]["healthcheck"] = {"tset": ["CMD", "true"]}
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    assert list(validator.iter_errors(broken))


def test_service_commands_are_the_readme_commands(compose: dict[str, Any]) -> None:
    """Every `dipaco` command of the stack is one the README uses, parses with the real CLI (options exist,
    values parse, required options are given by flag or environment), and carries each option the README gives
    that command, either as a flag or through the option's environment variable."""
    text = (ROOT / "README.md").read_text()
    readme_paths = {command_path(words[1:])[0] for words in markdown_commands(text)}
    readme_flags: dict[tuple[str, ...], set[str]] = {}  # the options of the README's runnable examples
    for words in markdown_commands(text, inline=False):
        flags = {w.split("=", 1)[0] for w in words if w.startswith("--")}
        readme_flags.setdefault(command_path(words[1:])[0], set()).update(flags)
    used = _dipaco_commands(compose)
    assert {tuple(words[1:3]) for _, words, _ in used} >= {
        ("coordinator", "migrate"),
        ("coordinator", "serve"),
        ("router", "corpus"),
        ("router", "shard"),
        ("router", "register"),
        ("island", "join"),
    }
    for service, words, env in used:
        parsed = parse_dipaco(words, env)
        assert parsed.path in readme_paths, f"service {service}: `dipaco {' '.join(parsed.path)}` is not in the README"
        for flag in readme_flags.get(parsed.path, set()) - LEFT_OUT.get(parsed.path, set()) - {"--help"}:
            given = flag in parsed.flags or bool(envvars_of(parsed.command, flag) & set(env))
            assert given, f"service {service}: README's {flag} of {parsed.path} is missing"


def test_the_stack_has_every_piece_in_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "minio", "bucket", "migrate", "coordinator", "router", "island"}
    after = {name: s.get("depends_on", {}) for name, s in services.items()}
    assert after["migrate"] == {"postgres": {"condition": "service_healthy"}}
    assert after["bucket"] == {"minio": {"condition": "service_healthy"}}
    assert after["coordinator"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "bucket": {"condition": "service_completed_successfully"},
    }
    assert after["router"] == after["island"] == {"coordinator": {"condition": "service_healthy"}}
    # the coordinator leaves the schema to the one-shot service, and keeps its image's /healthz check
    assert "--no-migrate" in services["coordinator"]["command"]
    assert "healthcheck" not in services["coordinator"]
    assert services["migrate"]["command"] == ["dipaco", "coordinator", "migrate"]
    # N CPU islands
    island = services["island"]
    assert island["deploy"]["replicas"] == "${DIPACO_ISLANDS:-2}"
    assert ["--device", "cpu"] == island["command"][island["command"].index("--device") :][:2]
    # on PostgreSQL and the S3 store
    coordinator_env = services["coordinator"]["environment"]
    assert coordinator_env["DIPACO_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert coordinator_env["DIPACO_BLOB_URL"].startswith("s3://")
    assert coordinator_env["DIPACO_S3_ENDPOINT_URL"] == "http://minio:9000"


def test_dipaco_containers_are_locked_down(compose: dict[str, Any]) -> None:
    ours = {n: s for n, s in compose["services"].items() if s.get("build")}
    assert set(ours) == {"bucket", "migrate", "coordinator", "router", "island"}
    for name, service in ours.items():
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile", "args": {"TORCH": "cpu"}}
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert "user" not in service, f"{name}: the image's non-root user is overridden"
    for name, service in compose["services"].items():  # published ports only on this machine
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"


def test_secrets_come_only_from_the_env_file(compose: dict[str, Any]) -> None:
    """Every secret-looking value is a required `${VAR:?...}` interpolation, and deploy/.env.example names every
    required variable with a placeholder only."""
    for name, service in compose["services"].items():
        for key, value in service.get("environment", {}).items():
            if SECRET_NAME.search(key):
                assert REQUIRED.search(str(value)), f"{name}: {key} is not taken from deploy/.env"
    required = set(REQUIRED.findall(COMPOSE.read_text()))
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert required <= set(example), f"deploy/.env.example lacks {required - set(example)}"
    for key, value in example.items():
        if SECRET_NAME.search(key):
            assert value == "CHANGE-ME", f"deploy/.env.example holds a value for {key}"
    assert ".env" in (DEPLOY / ".gitignore").read_text().split()


def test_the_router_job_registers_one_shard_per_path_of_the_demo_run(compose: dict[str, Any]) -> None:
    """The run spec the router job creates is a valid RunCreate, and `--paths` of its shard step equals the
    number of paths of that run's layout; the files it uses are the ones the image holds."""
    lines = _commands(compose["services"]["router"])
    create = next(words for words in lines if "create_run.py" in " ".join(words))
    spec_in_image = create[create.index("--spec") + 1]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY deploy/tools/ /opt/dipaco/tools/" in dockerfile
    assert "COPY deploy/demo/ /opt/dipaco/demo/" in dockerfile
    assert create[1] == "/opt/dipaco/tools/create_run.py" and (DEPLOY / "tools" / "create_run.py").is_file()
    spec = RunCreate.model_validate(
        json.loads((DEPLOY / spec_in_image.replace("/opt/dipaco/", "")).read_text()),
    )
    n_layers = spec.model.n_layers or flavour(spec.model.flavour).n_layers
    shard = next(words for words in lines if words[:3] == ["dipaco", "router", "shard"])
    assert int(shard[shard.index("--paths") + 1]) == parse_layout(spec.layout, n_layers=n_layers).num_paths
    bucket = compose["services"]["bucket"]["command"]
    assert bucket == ["python", "/opt/dipaco/tools/create_bucket.py"]
    assert (DEPLOY / "tools" / "create_bucket.py").is_file()
