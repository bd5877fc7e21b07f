"""The collective weight transports: the trainer sends a version into a vLLM actor's workers through vLLM's
weight-transfer engine, in the middle of a request (gloo here; NCCL when a GPU with a CUDA build of vLLM is
present)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from lockstep.api import WeightSyncBackend
from lockstep.protocol import TransferGroup


def _nccl_ready() -> bool:
    """Two CUDA GPUs (NCCL gives each rank its own: the trainer's and the actor's) and a CUDA build of vLLM."""
    import torch

    return torch.cuda.device_count() >= 2 and "cpu" not in __import__("vllm").__version__


def test_a_manifest_asked_for_by_many_at_once_hashes_its_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every actor of a barrier and the sender ask for a version's manifest as the barrier opens."""
    import torch

    from lockstep_workers.weights import transfer
    from lockstep_workers.weights.files import digest_of, publish, version_path

    publish({"w": torch.ones(4)}, tmp_path, version=7)
    hashing, go_on = threading.Event(), threading.Event()
    hashed: list[Path] = []

    def slow_digest(path: Path) -> str:
        hashed.append(path)
        hashing.set()
        go_on.wait(timeout=30)
        return digest_of(path)

    monkeypatch.setattr(transfer, "digest_of", slow_digest)
    path = version_path(tmp_path, 7)
    manifests: list[Any] = []
    first = threading.Thread(target=lambda: manifests.append(transfer.manifest_of(path, 7, "t:1")))
    second = threading.Thread(target=lambda: manifests.append(transfer.manifest_of(path, 7, "t:1")))
    first.start()
    assert hashing.wait(timeout=30)
    hashing.clear()
    second.start()
    hashing.wait(timeout=1)  # the second would hash too, were it not made to wait for the first
    go_on.set()
    first.join()
    second.join()
    assert hashed == [path] and manifests[0] == manifests[1]


def test_manifest_lists_the_published_tensors_and_refuses_another_version(tmp_path: Path) -> None:
    import torch

    from lockstep_e2e.cluster import free_port
    from lockstep_workers.weights.files import publish
    from lockstep_workers.weights.transfer import ManifestServer, fetch_manifest, manifest_uri

    state = {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(4, dtype=torch.bfloat16)}
    published = publish(state, tmp_path, version=3)
    port = free_port()
    ManifestServer(tmp_path, port, rendezvous="trainer:1234")
    announced = published.model_copy(update={"uri": manifest_uri("127.0.0.1", port, 3)})
    manifest = fetch_manifest(announced)
    assert manifest.host_and_port() == ("trainer", 1234)
    assert dict(zip(manifest.names, manifest.shapes, strict=True)) == {"a.weight": [2, 3], "b.bias": [4]}
    assert dict(zip(manifest.names, manifest.dtype_names, strict=True)) == {"a.weight": "float32", "b.bias": "bfloat16"}
    with pytest.raises(ValueError, match="was announced as sha256:0"):
        fetch_manifest(announced.model_copy(update={"digest": "sha256:" + "0" * 64}))
    with pytest.raises(OSError, match="404"):
        fetch_manifest(announced.model_copy(update={"uri": manifest_uri("127.0.0.1", port, 2), "version": 2}))


@pytest.mark.vllm
@pytest.mark.parametrize(
    "backend",
    [
        WeightSyncBackend.GLOO,
        pytest.param(
            WeightSyncBackend.NCCL,
            marks=pytest.mark.skipif(
                not _nccl_ready(),
                reason="NCCL needs two CUDA GPUs (one for the trainer, one for the actor) and a CUDA build of vLLM",
            ),
        ),
    ],
)
def test_the_trainer_sends_weights_into_a_running_actor(tmp_path: Path, backend: WeightSyncBackend) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parents[1] / "actor"))  # the actor's tests' helpers, by file name
    from test_server import LONG_REQUEST, PROMPT, assert_spans_the_update, updated_model
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_e2e.cluster import free_port
    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.tiny_model import cpu_vllm_settings, create_tiny_llama
    from lockstep_workers.weights.files import version_path
    from lockstep_workers.weights.transfer import ManifestServer, StagedTransfer, manifest_of, manifest_uri, send

    # Tied: vLLM's update_weights loads the embeddings and left the head's repacked copy stale (transfer.receive)
    model_dir = create_tiny_llama(tmp_path / "model", tie_word_embeddings=True)
    updated, published = updated_model(model_dir, tmp_path / "weights")
    http_port, rendezvous_port = free_port(), free_port()
    rendezvous = f"127.0.0.1:{rendezvous_port}"
    ManifestServer(tmp_path / "weights", http_port, rendezvous)
    weights = published.model_copy(update={"uri": manifest_uri("127.0.0.1", http_port, 1)})
    group = TransferGroup(rank_offset=1, world_size=2)
    sent: list[BaseException | None] = []

    def trainer() -> None:
        path = version_path(tmp_path / "weights", 1)
        if backend is WeightSyncBackend.NCCL:
            torch.cuda.set_device(1)  # vLLM's worker holds GPU 0
        try:
            send(path, manifest_of(path, 1, rendezvous), TransferGroup(rank_offset=0, world_size=2), backend)
            sent.append(None)
        except BaseException as error:  # reported by the assertion below
            sent.append(error)

    async def scenario() -> dict[str, Any]:
        llm = AsyncLLM.from_engine_args(engine_args(str(model_dir), applied_settings(cpu_vllm_settings()), backend))
        actor = Actor(llm, backend=backend)
        try:
            request = asyncio.create_task(actor.generate(PROMPT, LONG_REQUEST))
            await asyncio.sleep(0.5)
            staged = await asyncio.to_thread(StagedTransfer.fetch, weights, group)  # while generating
            await actor.pause()
            sender = threading.Thread(target=trainer)
            sender.start()
            await actor.load(weights, staged)
            await asyncio.to_thread(sender.join)
            await actor.resume()
            return await request
        finally:
            llm.shutdown()

    result = asyncio.run(scenario())
    assert sent == [None]
    assert_spans_the_update(result, model_dir, updated)


KILLED_AS_IT_ACCEPTS = """
import os, signal, socket, sys
socket.socket(fileno=int(sys.argv[1])).accept()
os.kill(os.getpid(), signal.SIGKILL)
"""
"""A sender that is SIGKILLed as the first receiver connects to its rendezvous (the listening socket, inherited)."""


@pytest.mark.timeout(45)  # well under the 60 s + a back-off + 60 s that torch's store client alone waited
def test_a_receiver_whose_sender_is_killed_as_it_joins_gives_up_within_the_deadline() -> None:
    """The e2e sender kill's case: the sender dies while a receiver joins its group, the receiver's connection is
    reset and the sender's port closed. The receiver's join fails (within GROUP_TIMEOUT: here within
    STORE_CONNECT_TIMEOUT's retry), and the barrier retries it in a new group."""
    from lockstep_workers.weights.transfer import gloo_group

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sender = subprocess.Popen(
            [sys.executable, "-c", KILLED_AS_IT_ACCEPTS, str(listener.fileno())], pass_fds=[listener.fileno()]
        )
    try:
        with pytest.raises((RuntimeError, TimeoutError)):
            gloo_group("127.0.0.1", port, 1, 2)
    finally:
        sender.wait()
    assert sender.returncode == -signal.SIGKILL
