"""The lockstep CLI says offline what the cluster says: the same words for the same bad RLJob."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from lockstep_e2e import build
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.fixtures import push_weights, running_job
from lockstep_e2e.jobs import rljob

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]

BAD_SPECS = {
    "negative replicas": {"actors": {"image": "a", "replicas": -1}},
    "wrong kwarg type": {"actors": {"image": "a", "vllm": {"maxModelLen": "long"}}},
    "out of range": {"actors": {"image": "a", "vllm": {"gpuMemoryUtilization": 1.5}}},
    "missing image": {"actors": {"replicas": 1}},
    "unknown algorithm": {"trainer": {"image": "t", "objective": {"algorithm": "dpo"}}},
    "unknown field": {"actors": {"image": "a", "vlm": {}}},
    "locked key": {"actors": {"image": "a", "vllm": {"logprobsMode": "raw_logprobs", "asyncScheduling": True}}},
    "no weights volume": {"weightSync": {"backend": "filesystem"}},
    "rolling over gloo": {"weightSync": {"backend": "gloo", "mode": "Rolling"}},
    "lora over gloo": {"weightSync": {"backend": "gloo"}, "trainer": {"image": "t", "reward": "m:f", "lora": {}}},
    "reward not importable": {"trainer": {"image": "t", "reward": "rewards.py"}},
    "too few prompts": {"trainer": {"image": "t", "reward": "m:f", "replicas": 4, "rollout": {"promptsPerStep": 2}}},
    "no actors": {"actors": {"image": "a", "replicas": 0}},
    "veto with the correction off": {
        "trainer": {"image": "t", "reward": "m:f", "objective": {"rolloutCorrection": {"enabled": False, "veto": 1e-4}}}
    },
    "bad quantity": {"actors": {"image": "a", "resources": {"limits": {"cpu": "lots"}}}},
    "reserved env": {
        "actors": {
            "image": "a",
            "env": [
                {"name": "LOCKSTEP_CONFIG", "value": "/var/tmp/mine.json"},
                {"name": "LOCKSTEP_SHARED_DIR", "value": "/"},
            ],
        }
    },
    "reserved mount": {
        "trainer": {
            "image": "t",
            "reward": "m:f",
            "volumes": [{"name": "lockstep-mine", "emptyDir": {}}],
            "volumeMounts": [{"name": "lockstep-mine", "mountPath": "/etc/../etc/lockstep"}],
        }
    },
    "bad env": {"trainer": {"image": "t", "reward": "m:f", "env": [{"name": "MY VAR", "value": "1"}, {"value": "2"}]}},
    "a mount of the shared volume": {
        "actors": {
            "image": "a",
            "volumeMounts": [
                {"name": "lockstep-shared", "mountPath": "/mnt/all"},
                {"name": "lockstep-shared", "mountPath": "/mnt/other", "subPath": "uid-of-another-job"},
            ],
        }
    },
    "numerics and code env": {
        "actors": {
            "image": "a",
            "env": [{"name": "VLLM_ATTENTION_BACKEND", "value": "TORCH_SDPA"}, {"name": "PYTHONPATH", "value": "/x"}],
        }
    },
}
BAD_NAMES = {"dotted name": "my.job"}
GOOD_SPECS = {
    "a lora job": {"trainer": {"image": "t", "reward": "m:f", "lora": {"rank": 8, "targetModules": ["q_proj"]}}},
    "a whole number written as a float": {"trainer": {"image": "t", "reward": "m:f", "rollout": {"maxTokens": 16.0}}},
    "a vLLM variable that changes no number": {
        "actors": {"image": "a", "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]}
    },
    "a dataset file name over 255 characters": {
        "trainer": {"image": "t", "reward": "m:f", "dataset": {"train": f"/tmp/{'x' * 300}.jsonl"}}
    },
}


def lockstep_cli(*args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {})}
    return subprocess.run(
        [sys.executable, "-m", "lockstep.cli", *args], capture_output=True, text=True, check=False, env=env
    )


@pytest.mark.parametrize("case", [*BAD_SPECS, *BAD_NAMES])
def test_validate_says_what_the_api_server_says(
    cluster: LocalCluster, namespace: str, tmp_path: Path, case: str
) -> None:
    body: dict[str, Any] = rljob(BAD_NAMES.get(case, "bad"))
    body["spec"].update(BAD_SPECS.get(case, {}))
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(body))

    offline = lockstep_cli("validate", str(manifest))
    assert offline.returncode == 1
    lines = [line.strip() for line in offline.stdout.splitlines()[1:]]
    assert lines, offline.stdout

    applied = kubectl_create(cluster, namespace, manifest)
    assert applied.returncode != 0, "the API server accepted what validate refused"
    # The API server lists every schema error, but stops at the first refusing admission validation
    # (keys in VllmSettings order); validate lists every conflict, in that order.
    said = lines
    if case == "locked key":
        assert len(lines) == 2, "validate names both conflicting keys"
        said = lines[:1]
    for line in said:
        assert line in applied.stderr, f"{line!r} is not what the API server said:\n{applied.stderr}"


def kubectl_create(
    cluster: LocalCluster, namespace: str, manifest: Path, *flags: str
) -> subprocess.CompletedProcess[str]:
    command = [str(build.bin_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "create", "-n", namespace]
    return subprocess.run([*command, *flags, "-f", str(manifest)], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("case", GOOD_SPECS)
def test_validate_accepts_what_the_api_server_accepts(
    cluster: LocalCluster, namespace: str, tmp_path: Path, case: str
) -> None:
    """Issue 21 item 9: validate neither refuses what the API server takes nor prints a traceback for it."""
    body: dict[str, Any] = rljob("good")
    body["spec"].update(GOOD_SPECS[case])
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(body))
    applied = kubectl_create(cluster, namespace, manifest, "--dry-run=server")
    assert applied.returncode == 0, applied.stderr
    offline = lockstep_cli("validate", str(manifest))
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert "Traceback" not in offline.stderr and offline.stdout.splitlines()[-1].startswith(f"{manifest}: valid")


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_render_prints_the_locked_arguments() -> None:
    sample = EXAMPLES / "rljob-tiny.yaml"
    rendered = lockstep_cli("render", str(sample)).stdout.splitlines()
    assert rendered[0].startswith("# ParityPolicy 'default'; fingerprint sha256:")
    assert "--logprobs-mode=processed_logprobs" in rendered[1].split()
    assert "--max-model-len=512" in rendered[1].split()


def test_status_shows_phase_parity_and_barrier_history(
    cluster: LocalCluster, kube: client.ApiClient, namespace: str
) -> None:
    push_weights(kube, namespace, "shown", running_job(kube, namespace, "shown", 2), 1)
    shown = lockstep_cli("status", "shown", "-n", namespace, kubeconfig=cluster.kubeconfig)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"RLJob {namespace}/shown: Running, weights version 1, lag 0"
    assert lines[1].startswith("  restarts 0 (failures, against spec.maxRestarts), replacements 0")
    assert any(line.startswith("  ParityLocked=True (Locked)") for line in lines)
    assert any(
        line.startswith("  v1 Completed in ") and "Update" in line and "slowest shown-actor-" in line for line in lines
    )
