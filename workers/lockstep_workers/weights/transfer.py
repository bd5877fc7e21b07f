"""The collective weight transports (spec.weightSync.backend nccl or gloo): the trainer sends each weights
version straight into the actors' vLLM workers, in a process group formed for one barrier.

- **nccl** (GPU clusters): vLLM's NCCL weight-transfer engine receives in every vLLM worker; the trainer
  is rank 0 and sends with vLLM's packed NCCL broadcast.
- **gloo** (CPU clusters, and the tests here): the same engine lifecycle (start, receive and load
  layer by layer, finish) over a gloo process group, registered with vLLM's weight-transfer factory.

The trainer keeps each version it publishes as a safetensors file (also what it resumes from) and serves
the file's tensor list, its **manifest**, at the URI it announces. In the barrier's Update phase the
operator gives every member its rank in the group (``Command.group``): the trainer opens the rendezvous
as rank 0 and sends the file's tensors in manifest order; each actor fetches the manifest, checks that
its digest is the announced one, and receives through vLLM's weight-transfer API in its own process
(``AsyncLLM.init_weight_transfer_engine`` and friends), never through vLLM's HTTP dev endpoints.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from safetensors import safe_open

from lockstep.api import WeightSyncBackend
from lockstep.origin import TrainerManifest
from lockstep.protocol import TransferGroup, Weights
from lockstep.schema import Model
from lockstep_workers.weights.files import (
    SAFETENSORS_DTYPES,
    RefusedWeights,
    VerifiedWeights,
    digest_of,
    refused,
    version_path,
)

if TYPE_CHECKING:
    from lockstep_workers.agent.core import Staged

logger = logging.getLogger("lockstep.transfer")

GLOO_ENGINE = "lockstep_gloo"
"""The name the gloo engine is registered under in vLLM's WeightTransferEngineFactory."""
VLLM_ENGINE = {WeightSyncBackend.NCCL: "nccl", WeightSyncBackend.GLOO: GLOO_ENGINE}
GROUP_TIMEOUT = dt.timedelta(seconds=60)
"""gloo: a member's deadline for the others to join the group, and then for each tensor (each has it whole, so a
slow but healthy transfer is never cut short). A receiver whose sender is dead gives up: after GROUP_TIMEOUT if it
never reached the sender's rendezvous (gloo_group waits for it, not torch's store client, which retries a whole
timeout after a back-off); at once or within STORE_CONNECT_TIMEOUT's retry (about 12 s) if the sender dies as it
joins; as soon as gloo sees the connection closed, at the latest after the tensor's GROUP_TIMEOUT, if it dies while
it sends. The attempt then fails and the barrier retries it in a new group (vLLM's NCCL rendezvous waits 300 s; a
receive that hangs inside NCCL is ended only by the barrier's deadline)."""
STORE_CONNECT_TIMEOUT = dt.timedelta(seconds=5)
"""gloo: how long a receiver's store client may take to connect once the sender's rendezvous accepted connections:
a healthy store answers in milliseconds. torch retries it once after a back-off (8.6-12.2 s in all, measured here
with nothing listening; 114 s for a 60 s timeout in the e2e sender kill), which is why the wait for the sender is not
left to it."""


class Manifest(Model):
    """What the trainer serves at an announced URI: where to meet it, and the tensors it will send, in order."""

    version: int
    digest: str
    rendezvous: str = Field(description="host:port of the group's rendezvous (the trainer, rank 0)")
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def host_and_port(self) -> tuple[str, int]:
        host, _, port = self.rendezvous.rpartition(":")
        return host, int(port)

    def update_info(self) -> dict[str, Any]:
        """vLLM's update info for the NCCL-style engines."""
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}


_MANIFESTS = threading.Lock()


def manifest_of(path: Path, version: int, rendezvous: str) -> Manifest:
    """The manifest of a published weights file, from its header and its digest: computed once (a published
    version is never rewritten), however many ask for it at once (every actor of a barrier, and the sender)."""
    with _MANIFESTS:
        return _manifest_of(path, version, rendezvous)


@functools.lru_cache(maxsize=8)
def _manifest_of(path: Path, version: int, rendezvous: str) -> Manifest:
    names, dtypes, shapes = [], [], []
    with safe_open(str(path), "pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensor = checkpoint.get_slice(name)
            if tensor.get_dtype() not in _TORCH_DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {tensor.get_dtype()}, which cannot be sent")
            names.append(name)
            dtypes.append(_TORCH_DTYPES[tensor.get_dtype()])
            shapes.append(list(tensor.get_shape()))
    return Manifest(
        version=version, digest=digest_of(path), rendezvous=rendezvous, names=names, dtype_names=dtypes, shapes=shapes
    )


_TORCH_DTYPES = {
    name: str(dtype).removeprefix("torch.")
    for dtype, name in SAFETENSORS_DTYPES.items()
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
}
"""safetensors' dtype names → torch's, for the dtypes a transfer sends (every one the format has but float8)."""


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors one at a time, in manifest order."""
    with safe_open(str(path), "pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, checkpoint.get_tensor(name)


class ManifestServer:
    """Serves ``GET /weights/<version>``: the manifest of a version the trainer still keeps (404 otherwise)."""

    PATH = re.compile(r"^/weights/(\d+)$")

    def __init__(self, directory: Path, port: int, rendezvous: str) -> None:
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                match = served.PATH.match(self.path)
                version = int(match.group(1)) if match else None
                path = version_path(directory, version) if version is not None else None
                if version is None or path is None or not path.exists():
                    self.send_error(404, "no such weights version here (the trainer keeps the newest few)")
                    return
                body = manifest_of(path, version, rendezvous).model_dump_json(by_alias=True).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
        threading.Thread(target=self.server.serve_forever, name="manifest-server", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def manifest_uri(host: str, port: int, version: int) -> str:
    return TrainerManifest(host, port).uri(version)


@dataclass(frozen=True)
class TrainerManifests:
    """The collective backends' origin: the manifest server of the job's trainer rank 0, at ``host``:``port``
    ($LOCKSTEP_WEIGHTS_HOST, $LOCKSTEP_WEIGHTS_PORT); a version's only URI is ``manifest_uri`` of that version."""

    host: str
    port: int

    def check(self, weights: Weights) -> None:
        if (refusal := refused(weights, TrainerManifest(self.host, self.port))) is not None:
            raise refusal

    def read(self, weights: Weights) -> VerifiedWeights:
        raise RefusedWeights(
            f"refusing to read weights version {weights.version} at {weights.uri}: with a collective backend weights "
            "arrive only in a barrier's transfer group"
        )


def fetch_manifest(weights: Weights) -> Manifest:
    """The manifest at ``weights.uri``, checked against the announced digest."""
    with urllib.request.urlopen(weights.uri, timeout=30) as response:
        manifest = Manifest.model_validate(json.loads(response.read()))
    if (manifest.version, manifest.digest) != (weights.version, weights.digest):
        raise ValueError(
            f"the trainer serves version {manifest.version} ({manifest.digest}) at {weights.uri}, but version "
            f"{weights.version} was announced as {weights.digest}"
        )
    return manifest


@dataclass(frozen=True)
class StagedTransfer:
    """A member's part in a barrier's transfer group, checked before it pauses: the manifest the trainer serves for
    ``weights`` (its version and digest the announced ones) and the member's ranks (None: every member has them).
    The transfer itself is the swap; nothing is held in memory meanwhile."""

    weights: Weights
    manifest: Manifest
    group: TransferGroup | None
    seconds: float
    """How long the check took."""

    @classmethod
    def fetch(cls, weights: Weights, group: TransferGroup) -> StagedTransfer:
        """Fetch and check the manifest at ``weights.uri`` (fetch_manifest)."""
        started = time.monotonic()
        return cls(weights, fetch_manifest(weights), group, time.monotonic() - started)

    def close(self) -> None:
        """Nothing to release."""


def send(path: Path, manifest: Manifest, group: TransferGroup, backend: WeightSyncBackend) -> None:
    """Open the group as rank 0 and send the file's tensors; returns once every receiver has them."""
    host, port = manifest.host_and_port()
    tensors = _checkpoint_tensors(path)
    if backend is WeightSyncBackend.NCCL:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        communicator = trainer_init({"master_address": host, "master_port": port, "world_size": group.world_size})
        try:
            packed_nccl_broadcast_producer(
                iterator=((name, tensor.cuda()) for name, tensor in tensors),
                group=communicator,
                src=0,
                post_iter_func=lambda item: item[1],
            )
            torch.cuda.current_stream().synchronize()
        finally:
            communicator.destroy()  # type: ignore[no-untyped-call]
        return
    process_group = gloo_group(host, port, 0, group.world_size)
    for _name, tensor in tensors:
        process_group.broadcast(tensor.contiguous(), 0).wait()


class Sender:
    """The barrier Engine of trainer rank 0 with a collective backend: in the Update phase it sends the
    version from its own files to the group; pausing and resuming are the actors' part."""

    def __init__(self, directory: Path, rendezvous: str, backend: WeightSyncBackend) -> None:
        self.directory = directory
        self.rendezvous = rendezvous
        self.backend = backend

    def pause(self) -> None:
        pass

    def stage(self, weights: Weights, group: TransferGroup | None) -> StagedTransfer:
        """Check that this pod's file of ``weights.version`` is the announced one."""
        started = time.monotonic()
        manifest = manifest_of(version_path(self.directory, weights.version), weights.version, self.rendezvous)
        if manifest.digest != weights.digest:
            raise ValueError(
                f"{version_path(self.directory, weights.version)} is not weights version {weights.version} as "
                f"announced ({weights.digest})"
            )
        return StagedTransfer(weights, manifest, group, time.monotonic() - started)

    def swap(self, staged: Staged) -> None:
        """Send the staged version to the group (nothing when every member already has it)."""
        assert isinstance(staged, StagedTransfer), staged
        if staged.group is None:
            return
        logger.info("sending weights version %d to %d rank(s)", staged.weights.version, staged.group.world_size - 1)
        send(version_path(self.directory, staged.weights.version), staged.manifest, staged.group, self.backend)

    def resume(self) -> None:
        pass


def gloo_group(host: str, port: int, rank: int, world_size: int) -> Any:
    """A gloo process group of its own (not torch.distributed's default group, which the trainer's ranks use), the
    store of its rendezvous at ``host``:``port`` served by rank 0. vLLM's stateless_init_torch_distributed_process_group
    but for the receivers' wait for that store, bounded by GROUP_TIMEOUT here rather than by torch's client, which
    retries a whole timeout after a back-off (see STORE_CONNECT_TIMEOUT)."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore
    from vllm.distributed.utils import init_gloo_process_group
    from vllm.utils.network_utils import get_tcp_uri

    if rank == 0:
        store = TCPStore(host, port, world_size, is_master=True, timeout=GROUP_TIMEOUT, multi_tenant=True)
    else:
        _wait_for_rendezvous(host, port, time.monotonic() + GROUP_TIMEOUT.total_seconds())
        store = TCPStore(host, port, world_size, is_master=False, timeout=STORE_CONNECT_TIMEOUT, multi_tenant=True)
        store.set_timeout(GROUP_TIMEOUT)
    prefixed = PrefixStore(get_tcp_uri(host, port), store)
    return init_gloo_process_group(prefix_store=prefixed, group_rank=rank, group_size=world_size, timeout=GROUP_TIMEOUT)


def _wait_for_rendezvous(host: str, port: int, deadline: float) -> None:
    """Return once ``host``:``port`` accepts a connection; raise TimeoutError at ``deadline`` (time.monotonic)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no weight-transfer rendezvous at {host}:{port} within {GROUP_TIMEOUT.total_seconds():.0f} s: "
                    "the sender is not there"
                ) from error
            time.sleep(0.2)


async def receive(llm: Any, staged: StagedTransfer, backend: WeightSyncBackend) -> None:
    """Receive the staged version into every vLLM worker of ``llm`` (an AsyncLLM) and load it in place."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    manifest, group = staged.manifest, staged.group
    assert group is not None, "an actor receives only as a member of the group"
    host, port = manifest.host_and_port()
    init_info = {
        "master_address": host,
        "master_port": port,
        "rank_offset": group.rank_offset,
        "world_size": group.world_size,
        "packed": backend is WeightSyncBackend.NCCL,
    }
    await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
    try:
        # the ties, recorded before any update can break them, and the experts (lockstep_workers.actor.vllm_extension):
        # only once the group is formed, as the engine must not serve in between
        await llm.collective_rpc("lockstep_prepare_update")
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info=manifest.update_info()))
        await llm.finish_weight_update()
        await llm.collective_rpc("lockstep_retie")  # a tied head's derived copy (lockstep_workers.actor.vllm_extension)
    finally:
        await llm.shutdown_weight_transfer_engine()
