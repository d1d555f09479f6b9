"""deploy/install.sh, the image's install recipe, run here as the Dockerfile's build stage runs it: the build
context assembled from the Dockerfile's own COPY lines, the script called with the Dockerfile's own arguments,
into a fresh virtual environment; then the installed entrypoint starts every role's --help and the installed
package migrates a database (so the migrations are packaged).

Hermetic and cheap: the fresh environment sees the already-resolved dependencies of the test environment through
a .pth file and pip runs with no index, so pip finds torch and every dependency already satisfied and builds and
installs only the project itself (non-editable). DIPACO_DEPLOY_FULL_INSTALL=1 runs the same script from nothing
against the package indexes instead (minutes, network). No container engine runs here: the image itself is not
built (docs/DEPLOY.md)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.helpers import DEPLOY, ROOT, command_path

DOCKERFILE = DEPLOY / "Dockerfile"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    lines: list[str]


def _stages() -> list[Stage]:
    """The Dockerfile's stages, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            stages.append(Stage(name=line.split()[-1], lines=[]))
        if stages:
            stages[-1].lines.append(line)
    return stages


def _default_args() -> dict[str, str]:
    """Build arguments with their defaults, as `docker build` without --build-arg sees them."""
    args = {}
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"ARG (\w+)=(\S+)", line.strip())
        if match:
            args[match.group(1)] = match.group(2)
    return args


@dataclass(frozen=True, slots=True)
class Installed:
    venv: Path
    seconds: float
    log: str

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**_clean_env(), "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        return subprocess.run(
            [str(self.venv / "bin" / "dipaco-entrypoint"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=self.venv.parent,
        )


def _clean_env() -> dict[str, str]:
    """The environment without pip's, the project's and Python's own settings of this machine."""
    drop = ("PIP_", "DIPACO_", "PYTHON", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _assemble_context(dest: Path) -> Path:
    """The build stage's /src: each COPY of the build stage, from the repository root (the build context)."""
    (build,) = [s for s in _stages() if s.name == "build"]
    workdir = next(line.split()[1] for line in build.lines if line.startswith("WORKDIR "))
    assert workdir == "/src"
    for line in build.lines:
        if not line.startswith("COPY ") or "--from" in line:
            continue
        *sources, target = shlex.split(line)[1:]
        for source in sources:  # docker's rules: a directory's contents into the target; files into a dir/
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, dest / target, ignore=IGNORE, dirs_exist_ok=True)
            elif target.endswith("/"):
                (dest / target).mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / target / src.name)
            else:
                (dest / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / target)
    return dest


def _install_command(context: Path, venv: Path) -> list[str]:
    """The build stage's `RUN ... deploy/install.sh ...`, with the image's paths replaced by ours."""
    (build,) = [s for s in _stages() if s.name == "build"]
    (run,) = [line for line in build.lines if line.startswith("RUN ") and "deploy/install.sh" in line]
    words = shlex.split(run[len("RUN ") :])
    words = words[words.index("deploy/install.sh") :]
    defaults = _default_args()
    out = []
    for word in words:
        word = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], word)
        word = {"/opt/dipaco/venv": str(venv), "/src": str(context), "deploy/install.sh": ""}.get(word, word)
        out.append(word)
    return ["bash", str(context / "deploy" / "install.sh"), *[w for w in out if w]]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    base = tmp_path_factory.mktemp("install")
    context = _assemble_context(base / "src")
    venv = base / "venv"
    env = _clean_env()
    if os.environ.get("DIPACO_DEPLOY_FULL_INSTALL") == "1":
        env["PYTHON"] = sys.executable  # the script creates the environment itself
    else:
        # A fresh environment (no pip, no packages of its own) that sees the resolved dependencies of this one.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
        site = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(site, "_resolved_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        env |= {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_CONFIG_FILE": os.devnull}
    start = time.monotonic()
    done = subprocess.run(
        _install_command(context, venv), capture_output=True, text=True, env=env, timeout=1800, cwd=base
    )
    seconds = time.monotonic() - start
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    print(f"\ndeploy/install.sh: {seconds:.1f} s")
    return Installed(venv=venv, seconds=seconds, log=log)


def test_install_script_builds_the_environment(installed: Installed) -> None:
    """The project is installed into the fresh environment (not the editable checkout), with the entrypoint."""
    assert "install.sh: done" in installed.log
    assert "torch==2.13.0 (CPU build)" in installed.log  # the Dockerfile's default TORCH=cpu
    where = installed.run(
        "python", "-c", "import coordinator, dipaco, island, migrations, modules, router; print(dipaco.__file__)"
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout
    assert (installed.venv / "bin" / "dipaco-entrypoint").stat().st_mode & 0o111


def _roles() -> list[list[str]]:
    """Every command of the roles the image runs (coordinator, island, router), found in the CLI itself."""
    _, root, _ = command_path([])
    roles: list[list[str]] = [[]]
    for group in ("coordinator", "island", "router"):
        roles += [[group, name] for name in sorted(root.commands[group].commands)]
    return roles


def test_entrypoint_starts_every_role(installed: Installed) -> None:
    """Both forms the entrypoint takes (`IMAGE island join` and `IMAGE dipaco island join`, alternately, so each
    role starts once), and `python -m dipaco`, which `torchrun -m dipaco` starts on every rank."""
    runs = [["dipaco", *role, "--help"] if i % 2 else [*role, "--help"] for i, role in enumerate(_roles())]
    runs.append(["python", "-m", "dipaco", "island", "join", "--help"])
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda args: installed.run(*args), runs))
    failed = [
        f"{' '.join(a)}: rc {r.returncode}: {r.stderr[-500:]}"
        for a, r in zip(runs, results, strict=True)
        if r.returncode or "Usage" not in r.stdout
    ]
    assert failed == []


def test_installed_package_migrates_a_database(installed: Installed, tmp_path: Path) -> None:
    """The migrations travel in the wheel: the installed command brings a fresh SQLite file to head."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    migrated = installed.run("coordinator", "migrate", "--database-url", url)
    assert migrated.returncode == 0, migrated.stderr
    assert "migrated from no revision (empty schema) to" in migrated.stdout
    assert installed.run("coordinator", "migrate", "--check", "--database-url", url).returncode == 0


def test_torch_pin_is_the_makefiles() -> None:
    pinned = re.search(r"^TORCH_VERSION=(\S+)", (DEPLOY / "install.sh").read_text(), re.M)
    assert pinned is not None
    assert f"torch=={pinned.group(1)}" in (ROOT / "Makefile").read_text()


def test_install_script_refuses_an_unknown_torch_build(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(DEPLOY / "install.sh"), "--torch", "rocm", "--venv", str(tmp_path / "v")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--torch must be cpu, cuda or none" in done.stderr
    assert not (tmp_path / "v").exists()


def test_dockerfile_is_multi_stage_non_root_with_a_healthcheck() -> None:
    """What can be checked without a container engine (none runs here, so the image is not built)."""
    stages = _stages()
    assert [s.name for s in stages] == ["build", "runtime"]
    runtime = stages[-1].lines
    assert "COPY --from=build /opt/dipaco/venv /opt/dipaco/venv" in runtime
    assert not any("install.sh" in line for line in runtime)  # nothing is built in the final image
    (user,) = [line for line in runtime if line.startswith("USER ")]
    uid, gid = user.split()[1].split(":")
    assert int(uid) >= 1000 and int(gid) >= 1000
    (health,) = [line for line in runtime if line.startswith("HEALTHCHECK ")]
    assert "/healthz" in health
    assert 'ENTRYPOINT ["dipaco-entrypoint"]' in runtime
    assert _default_args()["TORCH"] == "cpu"
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {"**/.venv", "**/.git", "deploy/.env"} <= set(ignored)
