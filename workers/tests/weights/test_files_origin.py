"""An actor loads weights only from its own job: files that resolve inside the job's weights directory
(filesystem backend), or its trainer rank 0's manifest of the commanded version (nccl, gloo). Whoever can forge
an announcement supplies the URI and the digest together, so a matching digest proves nothing; a refused URI is
an error ack (or, for the initial weights, a failed start), never a load."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.api import WeightSyncBackend
from lockstep.protocol import BarrierPhase, Command, Weights
from lockstep_workers.actor.server import Actor, LoopEngine, weights_origin
from lockstep_workers.agent.core import AgentCore
from lockstep_workers.weights.files import (
    RETAIN_SECONDS,
    DigestMismatch,
    RefusedWeights,
    WeightsDirectory,
    digest_of,
    local_path,
    publish,
)
from lockstep_workers.weights.transfer import TrainerManifests, manifest_uri

TENSORS = {"w": torch.arange(4, dtype=torch.float32)}


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """The job's directory ($LOCKSTEP_SHARED_DIR) with version 1 published in its weights directory."""
    publish(TENSORS, tmp_path / "job" / "weights", version=1)
    return tmp_path / "job"


def at(uri: str, version: int = 1) -> Weights:
    return Weights(version=version, uri=uri, digest="sha256:" + "0" * 64)


def test_the_filesystem_origin_accepts_only_files_inside_the_jobs_weights_directory(
    shared: Path, tmp_path: Path
) -> None:
    directory = shared / "weights"
    origin = WeightsDirectory(directory)
    inside = directory / "v000001.safetensors"
    origin.check(at(inside.as_uri()))

    elsewhere = publish(TENSORS, tmp_path / "attacker", version=1)  # a real file, digest and all
    (shared / "metrics.jsonl").write_text("{}\n")
    outside = {
        "another directory": elsewhere.uri,
        "the job's directory, beside weights/": (shared / "metrics.jsonl").as_uri(),
        "'..' out of the directory": f"file://{directory}/../../attacker/weights/v000001.safetensors",
        "a percent-escaped '..'": f"file://{directory}/%2e%2e/%2e%2e/attacker/weights/v000001.safetensors",
        "the directory itself": directory.as_uri(),
        "another host": f"file://attacker{inside}",
        "localhost": f"file://localhost{inside}",
        "'..' that stays inside": (directory / "sub" / ".." / inside.name).as_uri(),
        "not a file": manifest_uri("127.0.0.1", 9500, 1),
    }
    for case, uri in outside.items():
        with pytest.raises(RefusedWeights) as refused:
            origin.check(at(uri))
        assert uri in str(refused.value) and str(directory) in str(refused.value), case


def test_a_symlink_inside_the_directory_that_points_outside_is_refused(shared: Path, tmp_path: Path) -> None:
    elsewhere = publish(TENSORS, tmp_path / "attacker", version=2)
    link = shared / "weights" / "v000002.safetensors"
    link.symlink_to(Path(elsewhere.uri.removeprefix("file://")))
    (shared / "weights" / "escape").symlink_to(tmp_path / "attacker")

    origin = WeightsDirectory(shared / "weights")
    for uri in (link.as_uri(), (shared / "weights" / "escape" / "v000002.safetensors").as_uri()):
        with pytest.raises(RefusedWeights, match=r"resolves to .*attacker.*, not a file in the job's weights"):
            origin.read(elsewhere.model_copy(update={"uri": uri}))


def test_a_collective_origin_accepts_only_its_trainers_manifest_of_the_commanded_version() -> None:
    host = "job-trainer-0.job-trainer.ns.svc"
    origin = TrainerManifests(host, 9500)
    origin.check(at(f"http://{host}:9500/weights/7", version=7))
    wrong = {
        "another host": "http://attacker.ns.svc:9500/weights/7",
        "another port": f"http://{host}:9501/weights/7",
        "another version": f"http://{host}:9500/weights/6",
        "another path": f"http://{host}:9500/weights/7/../../other/7",
        "a query": f"http://{host}:9500/weights/7?from=elsewhere",
        "user info": f"http://attacker@{host}:9500/weights/7",
        "https": f"https://{host}:9500/weights/7",
        "a file": "file:///job/weights/v000007.safetensors",
    }
    for case, uri in wrong.items():
        with pytest.raises(RefusedWeights) as refused:
            origin.check(at(uri, version=7))
        assert uri in str(refused.value) and f"http://{host}:9500/weights/7" in str(refused.value), case


def test_the_actor_takes_its_origin_from_the_pods_environment(tmp_path: Path) -> None:
    environ = {
        "LOCKSTEP_SHARED_DIR": str(tmp_path),
        "LOCKSTEP_WEIGHTS_HOST": "trainer-0.svc",
        "LOCKSTEP_WEIGHTS_PORT": "9500",
    }
    assert weights_origin(WeightSyncBackend.FILESYSTEM, environ) == WeightsDirectory(tmp_path / "weights")
    assert weights_origin(WeightSyncBackend.GLOO, environ) == TrainerManifests("trainer-0.svc", 9500)
    with pytest.raises(SystemExit, match=r"LOCKSTEP_WEIGHTS_HOST and LOCKSTEP_WEIGHTS_PORT not set: with .* nccl"):
        weights_origin(WeightSyncBackend.NCCL, {"LOCKSTEP_SHARED_DIR": str(tmp_path)})
    with pytest.raises(SystemExit, match=r"LOCKSTEP_SHARED_DIR not set: with weightSync.backend filesystem"):
        weights_origin(WeightSyncBackend.FILESYSTEM, {})


@dataclass
class RecordingLLM:
    """The part of vLLM's AsyncLLM that the Actor drives for a file load, recorded."""

    calls: list[str] = field(default_factory=list)

    async def pause_generation(self, **_: Any) -> None:
        self.calls.append("pause")

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> None:
        """Records the call, and the digest of what the worker would read at the path it is given."""
        self.calls.append(f"{method} {digest_of(Path(args[0]))}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The actor's event loop, in a thread of its own (the agent calls in from another)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def test_the_agent_acks_a_refused_uri_as_an_error_and_loads_nothing(
    shared: Path, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    llm = RecordingLLM()
    agent = AgentCore(LoopEngine(Actor(llm), loop, WeightsDirectory(shared / "weights")))
    forged = publish(TENSORS, tmp_path / "attacker", version=1)  # its digest matches its file

    with pytest.raises(RefusedWeights, match="outside the job's weights directory"):
        agent.start(forged)  # lockstep.dev/initial-weights: the actor does not start on them
    assert agent.loaded is None and llm.calls == []

    command = Command(id="job/1/1", version=1, uri=forged.uri, digest=forged.digest, phase=BarrierPhase.UPDATE)
    ack = agent.handle(command)
    assert ack.error is not None and forged.uri in ack.error and "RefusedWeights" in ack.error
    assert ack.loaded_version is None and llm.calls == [], "refused before staging: never paused, nothing loaded"

    genuine = publish(TENSORS, shared / "weights", version=2)
    ack = agent.handle(
        Command(id="job/2/1", version=2, uri=genuine.uri, digest=genuine.digest, phase=BarrierPhase.UPDATE)
    )
    assert ack.error is None and ack.loaded_version == 2
    assert llm.calls == ["pause", f"lockstep_reload {genuine.digest}"]


def test_a_file_changed_after_its_announcement_is_an_error_ack_before_any_pause(
    shared: Path, loop: asyncio.AbstractEventLoop
) -> None:
    """Staging reads and hashes the file while the actor still generates: bytes that are not the announced ones
    are this member's error ack (DigestMismatch), before it pauses and with nothing loaded; the operator's retry,
    once the file holds the announced bytes again, loads them."""
    llm = RecordingLLM()
    agent = AgentCore(LoopEngine(Actor(llm), loop, WeightsDirectory(shared / "weights")))
    announced = publish(TENSORS, shared / "weights", version=2)
    path = local_path(announced)
    genuine = path.read_bytes()
    path.write_bytes(genuine[:-1] + bytes([genuine[-1] ^ 1]))  # one bit of the last tensor flipped, in place

    update = Command(id="job/2/1", version=2, uri=announced.uri, digest=announced.digest, phase=BarrierPhase.UPDATE)
    ack = agent.handle(update)
    assert ack.error is not None and "DigestMismatch" in ack.error and announced.digest in ack.error
    assert ack.loaded_version is None and llm.calls == [] and not agent.paused, "never paused, nothing loaded"

    path.write_bytes(genuine)
    ack = agent.handle(update.model_copy(update={"retry": 1}))
    assert ack.error is None and ack.loaded_version == 2 and ack.retry == 1
    assert llm.calls == ["pause", f"lockstep_reload {announced.digest}"]


def test_a_published_version_stays_while_a_new_actor_may_still_start_from_it(tmp_path: Path) -> None:
    """A version goes only once it is neither among the newest ``keep`` nor younger than RETAIN_SECONDS (a new
    actor reads the version committed when its pod was created, after its pod started)."""
    directory = tmp_path / "weights"
    first = publish(TENSORS, directory, version=1, keep=1)
    publish(TENSORS, directory, version=2, keep=1)
    assert local_path(first).exists(), "version 1 was published moments ago"
    long_ago = time.time() - RETAIN_SECONDS - 1
    os.utime(local_path(first), (long_ago, long_ago))
    publish(TENSORS, directory, version=3, keep=1)
    assert not local_path(first).exists()
    assert sorted(p.name for p in directory.glob("v*.safetensors")) == ["v000002.safetensors", "v000003.safetensors"]


def test_the_actor_loads_the_bytes_it_checked_though_the_file_is_swapped_after_the_check(
    shared: Path, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    """The check, the digest and the load concern one opened file: replacing the path (a symlink swapped, a file
    renamed over it) once it was read changes nothing that is loaded; a digest that does not match is refused."""
    directory = shared / "weights"
    genuine = publish(TENSORS, directory, version=2)
    planted = publish({"w": torch.full((4,), 999.0)}, tmp_path / "attacker", version=2)
    origin = WeightsDirectory(directory)
    with origin.read(genuine) as verified:
        path = local_path(genuine)
        path.unlink()
        path.symlink_to(local_path(planted))  # what a reopen of the path would now read
        assert digest_of(path) == planted.digest
        llm = RecordingLLM()
        asyncio.run_coroutine_threadsafe(Actor(llm).load(genuine, verified), loop).result()
    assert llm.calls == [f"lockstep_reload {genuine.digest}"], "the checked bytes, not the planted file"

    with pytest.raises(RefusedWeights, match=r"resolves to .*attacker"):
        origin.read(genuine)  # the path now leads out of the directory
    (directory / "v000003.safetensors").write_bytes(local_path(planted).read_bytes())
    with pytest.raises(DigestMismatch, match=r"v000003\.safetensors has digest"):
        origin.read(genuine.model_copy(update={"version": 3, "uri": (directory / "v000003.safetensors").as_uri()}))


def test_the_verified_copy_is_sealed(shared: Path) -> None:
    weights = publish(TENSORS, shared / "weights", version=2)
    with WeightsDirectory(shared / "weights").read(weights) as verified:
        with pytest.raises(PermissionError):
            Path(verified.path).write_bytes(b"other weights")
        assert digest_of(Path(verified.path)) == weights.digest
