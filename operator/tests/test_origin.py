"""lockstep.origin: the one check of an announced URI, made by the operator and by each pod's agent."""

from __future__ import annotations

from pathlib import PurePosixPath
from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockstep.origin import TrainerManifest, WeightsFiles, origin_problem

UID = "0b5e7c1e-3d7a-4f0e-9a57-5f4d7c1e2b3a"
OTHER = "9f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f"
FILES = WeightsFiles(PurePosixPath(f"/var/lib/lockstep/{UID}/weights"))
TRAINER = TrainerManifest("job-trainer-0.job-trainer.ns.svc", 9500)


@pytest.mark.parametrize(
    "uri",
    [
        f"file:///var/lib/lockstep/{UID}/weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights/sub/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}//weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights/v%20007.safetensors",
    ],
)
def test_a_file_in_the_jobs_weights_directory_is_its_origin(uri: str) -> None:
    assert origin_problem(uri, 7, FILES) is None


@pytest.mark.parametrize(
    "uri",
    [
        f"file:///etc/{UID}/passwd",
        f"file:///etc/{UID}/weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{OTHER}/{UID}/v1",
        f"file:///var/lib/lockstep/{OTHER}/weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/checkpoints/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights",
        f"file:///var/lib/lockstep/{UID}/weights/",
        f"file://evil.example/var/lib/lockstep/{UID}/weights/v000007.safetensors",
        f"file://localhost/var/lib/lockstep/{UID}/weights/v000007.safetensors",
        f"file:/var/lib/lockstep/{UID}/weights/v000007.safetensors",
        f"FILE:///var/lib/lockstep/{UID}/weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights/../../{OTHER}/weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights/%2e%2e/%2E%2E/{OTHER}/weights/v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights/./v000007.safetensors",
        f"file:///var/lib/lockstep/{UID}/weights/v000007.safetensors?x=1",
        f"file:///var/lib/lockstep/{UID}/weights/v000007.safetensors#x",
        f"file:///var/lib/lockstep/{UID}/weights/v%00.safetensors",
        f"http://job-trainer-0.job-trainer.ns.svc:9500/var/lib/lockstep/{UID}/weights/v000007.safetensors",
        f"/var/lib/lockstep/{UID}/weights/v000007.safetensors",
    ],
)
def test_anything_else_is_refused_on_a_filesystem_job(uri: str) -> None:
    assert origin_problem(uri, 7, FILES) is not None


def test_a_collective_job_takes_exactly_its_trainers_manifest_of_the_version() -> None:
    assert origin_problem("http://job-trainer-0.job-trainer.ns.svc:9500/weights/7", 7, TRAINER) is None
    for uri in (
        "http://other-trainer-0.other-trainer.f.svc:9500/weights/7",
        "http://169.254.169.254:80/weights/7",
        "http://user:pw@evil.example/weights/7",
        "http://user:pw@job-trainer-0.job-trainer.ns.svc:9500/weights/7",
        "http://job-trainer-0.job-trainer.ns.svc:9501/weights/7",
        "http://job-trainer-0.job-trainer.ns.svc/weights/7",
        "http://job-trainer-0.job-trainer.ns.svc:9500/weights/6",
        "http://job-trainer-0.job-trainer.ns.svc:9500/weights/7?x",
        "http://job-trainer-0.job-trainer.ns.svc:9500/weights/7/../7",
        "https://job-trainer-0.job-trainer.ns.svc:9500/weights/7",
        "HTTP://job-trainer-0.job-trainer.ns.svc:9500/weights/7",
        f"file:///var/lib/lockstep/{UID}/weights/v000007.safetensors",
    ):
        assert origin_problem(uri, 7, TRAINER) is not None, uri


SEGMENT = st.text(st.sampled_from("abc.%2eE/"), min_size=1, max_size=12)


@given(st.lists(SEGMENT, min_size=1, max_size=6))
def test_an_accepted_file_always_lies_in_the_weights_directory(segments: list[str]) -> None:
    """Whatever the escapes and dots, an accepted URI, read as a path the way a kernel does ('..' steps up),
    stays under the directory."""
    uri = f"file:///var/lib/lockstep/{UID}/weights/" + "/".join(segments)
    if origin_problem(uri, 1, FILES) is not None:
        return
    resolved: list[str] = []
    for part in unquote(uri.removeprefix("file://")).split("/"):
        if part == "..":
            resolved = resolved[:-1]
        elif part not in ("", "."):
            resolved.append(part)
    path = PurePosixPath("/", *resolved)
    assert FILES.directory in path.parents, uri
