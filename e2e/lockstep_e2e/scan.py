"""`make scan`: checkov over what Lockstep puts in a cluster, the Helm chart as it renders and what the operator
creates for each example RLJob (its pods, actors, trainers and preflight pod, and their other children, under the
default ParityPolicy).

checkov lives in a virtualenv of its own (its pins, requirements/lint.txt, conflict with the project's);
``--checkov`` names its command. The checks it skips, each with its reason, are in .checkov.yaml.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import yaml

from lockstep import desired
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
from lockstep_e2e.install import REPO, helm_template

EXAMPLES = REPO / "examples"
CONFIG = REPO / ".checkov.yaml"


def example_objects(example: Path) -> list[dict[str, Any]]:
    """What the operator creates for an example RLJob: its pods (actors, trainers, the preflight pod; actor groups as
    the pods their LeaderWorkerSet creates, and the set), their identity and access, the effective config, the
    Services and the NetworkPolicy."""
    manifest = yaml.safe_load(example.read_text())
    spec = RLJobSpec.model_validate(manifest["spec"])
    config = effective_config(spec, default_policy())
    job = desired.JobRef(name=manifest["metadata"]["name"], namespace="team", uid=str(uuid.UUID(int=0)))
    pods = [*desired.pods(job, spec, config), desired.preflight_pod(job, spec, config)]
    groups = desired.group_pods(job, spec, config)
    return [
        *pods,
        *groups,
        *([desired.actor_groups(job, spec, config)] if groups else []),
        *desired.worker_access(job, [pod["metadata"]["name"] for pod in pods]),
        desired.config_map(job, spec, config),
        *desired.services(job),
        desired.network_policy(job, spec),
    ]


def write_manifests(directory: Path) -> list[Path]:
    """The chart's and the examples' manifests, one file each, in ``directory``."""
    files = {"chart.yaml": yaml.safe_dump_all(helm_template(), sort_keys=False)}
    for example in sorted(EXAMPLES.glob("*.yaml")):
        files[f"job-{example.stem}.yaml"] = yaml.safe_dump_all(example_objects(example), sort_keys=False)
    paths = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lockstep_e2e.scan", description=__doc__.splitlines()[0])
    parser.add_argument("--checkov", required=True, help="the checkov command (make scan: .venv-lint/bin/checkov)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lockstep-scan-") as directory:
        files = write_manifests(Path(directory))
        # --skip-download: checkov fetches guideline links from Prisma Cloud otherwise; the checks run offline.
        command = [
            args.checkov,
            f"--config-file={CONFIG}",
            "--framework=kubernetes",
            "--compact",
            "--quiet",
            "--skip-download",
        ]
        return subprocess.run([*command, *(f"--file={path}" for path in files)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
