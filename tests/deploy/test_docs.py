"""docs/DEPLOY.md stays honest: every `dipaco` command it shows parses with the real CLI (in code blocks: fully,
options and values; in the prose: the command exists), every install.sh call uses options the script has,
every file and kustomize directory it names exists, and the README links it."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.helpers import (
    DEPLOY,
    ROOT,
    code_lines,
    command_path,
    embedded_dipaco,
    markdown_commands,
    parse_dipaco,
)

DOC = ROOT / "docs" / "DEPLOY.md"
# what the doc's commands take from the environment, as its text says
ENV = {"DIPACO_JOIN_TOKEN": "j" * 20, "DIPACO_ADMIN_TOKEN": "a" * 20}


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


def test_code_block_commands_parse(text: str) -> None:
    commands = [c for c in (embedded_dipaco(words) for words in code_lines(text)) if c]
    assert len(commands) >= 8  # the doc does show commands; a parsing slip would otherwise pass silently
    for command in commands:
        parse_dipaco(command, ENV)


def test_prose_commands_exist(text: str) -> None:
    spans = [words for words in markdown_commands(text) if len(words) > 1]
    for words in spans:
        path, node, _ = command_path(words[1:])
        assert path and not hasattr(node, "commands") or path == ("registry",), f"no such command: {words}"


def test_install_script_calls_use_its_options(text: str) -> None:
    usage = subprocess.run(["bash", str(DEPLOY / "install.sh"), "--help"], capture_output=True, text=True)
    options = set(re.findall(r"(--[a-z]+)", usage.stdout))
    assert {"--venv", "--torch", "--extras"} <= options
    calls = [words for words in code_lines(text) if words[0].endswith("install.sh")]
    calls += [w.split() for w in re.findall(r"`(deploy/install\.sh[^`]*)`", text)]
    assert calls
    for words in calls:
        for i, word in enumerate(words):
            if word.startswith("--"):
                assert word in options, f"install.sh has no {word}"
            if word == "--torch":
                assert words[i + 1] in ("cpu", "cuda", "none")


def test_named_files_and_overlays_exist(text: str) -> None:
    made_by_the_user = {f"deploy/{line}" for line in (DEPLOY / ".gitignore").read_text().split() if "#" not in line}
    for path in set(re.findall(r"(?<![\w/])(deploy/[\w./-]+\w)", text)) - made_by_the_user:
        assert (ROOT / path).exists(), f"docs/DEPLOY.md names {path}, which does not exist"
    for words in code_lines(text):
        if words[:2] == ["kubectl", "apply"]:
            assert (ROOT / words[words.index("-k") + 1] / "kustomization.yaml").is_file()
        if words[:2] == ["docker", "compose"]:
            assert (ROOT / words[words.index("-f") + 1]).is_file()
        if words[:1] == ["docker"] and "build" in words:
            assert (ROOT / words[words.index("-f") + 1]).is_file()


def test_readme_links_the_deploy_doc() -> None:
    assert "[docs/DEPLOY.md](docs/DEPLOY.md)" in (ROOT / "README.md").read_text()


def test_the_doc_says_what_was_not_run(text: str) -> None:
    assert "No container engine runs on the machines this project is developed and" in text
