"""The container image runs the README's install (the Makefile's `install` recipe), and the
manifests only start `openrl` commands that exist. (No container engine runs here: the image
itself is not built by the tests.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from functions.cli import main
from functions.deploy.config import checked
from functions.deploy.render import render, worker_templates

ROOT = Path(__file__).resolve().parents[1]
# Commands the manifests start that arrive with the node timeslicer (issue 11).
UPCOMING_COMMANDS = {"timeslicer"}


def normalise(command: str) -> str:
    command = command.replace("$(PIP)", "pip").replace("$(PY)", "python").replace("/tmp/constraints.txt", "CONSTRAINTS")
    return re.sub(r"(?<![\w/])constraints\.txt", "CONSTRAINTS", " ".join(command.split()))


def makefile_install() -> list[str]:
    recipe = ROOT.joinpath("Makefile").read_text().split("$(STAMP): pyproject.toml constraints.txt\n", 1)[1]
    lines = []
    for line in recipe.splitlines():
        if not line.startswith("\t"):
            break
        line = line.strip()
        if line.startswith(("$(PIP) install", "$(PY) -m")):
            lines.append(normalise(line))
    return lines


def containerfile_runs() -> list[str]:
    text = ROOT.joinpath("Containerfile").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            commands.extend(normalise(part) for part in line[4:].split("&&"))
    return commands


def test_the_image_runs_the_makefiles_install_steps_in_order():
    steps = makefile_install()
    assert len(steps) == 5 and steps[1] == 'pip install -q -c CONSTRAINTS -e ".[dev,cookbook]"'
    runs = containerfile_runs()
    positions = [runs.index(step) for step in steps]
    assert positions == sorted(positions)


def test_the_image_pins_the_same_torch_as_constraints():
    pinned = re.search(r"^torch==([\d.]+)", ROOT.joinpath("constraints.txt").read_text(), re.M).group(1)
    assert re.search(r"^ARG TORCH=(.+)$", ROOT.joinpath("Containerfile").read_text(), re.M).group(1) == pinned


@pytest.mark.parametrize("overlays", [["single-node"], ["gpu"]])
def test_every_command_a_manifest_starts_exists(overlays, capsys):
    config = checked(image="i:1", overlays=overlays, tenants=["alice"])
    objects = [*render(config), *worker_templates(config).values()]
    commands = set()
    for obj in objects:
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if container["image"] == "i:1":
                commands.add(
                    tuple(container["args"][:2]) if container["args"][0] == "function" else (container["args"][0],)
                )
    assert commands
    for command in sorted(commands - {(c,) for c in UPCOMING_COMMANDS}):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
    capsys.readouterr()
