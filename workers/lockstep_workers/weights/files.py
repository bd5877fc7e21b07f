"""The filesystem weight transport: safetensors files on a volume shared by the trainer and the actors.

The trainer publishes version N as ``v000N.safetensors``: written to a hidden temporary name and hashed as it is
written (one pass), flushed to disk with its directory, renamed into place (atomic), and announced with its sha256;
older versions beyond ``keep`` are removed. Trainer rank 0 publishes in the background (``Publisher``), one
version at a time, while its next step runs. An actor opens a version only from its job's own weights directory
(``WeightsDirectory``), reads it once into a sealed copy in memory while hashing it, and loads that copy only if its
digest is the one it was told.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lockstep.origin import WEIGHTS_DIRECTORY, TrainerManifest, WeightsFiles, origin_problem
from lockstep.protocol import Weights

logger = logging.getLogger("lockstep.weights")


class DigestMismatch(OSError):
    """The file is not the one that was announced."""


class RefusedWeights(ValueError):
    """Weights announced at a URI outside the job's own weights: never loaded."""


class NonFiniteWeights(ValueError):
    """A tensor of a weights version holds a NaN or an infinite value (a diverged step): never published, and an
    actor never loads such a version."""


FINITE_CHECK_ELEMENTS = 1 << 24
"""How many elements of a tensor ``finite`` checks at once: its mask is at most this many bytes, whatever the
tensor's size."""


def finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (a tensor that is not floating point always is), a slice at a time.
    A slice whose sum is finite holds no NaN or infinity (either would make the sum one): one fast reduction, over ten
    times isfinite's speed on a CPU; only a slice whose sum is not finite (a NaN, or finite values that overflow it)
    is checked value by value. fp8 slices are widened first: torch has neither sum nor isfinite for float8_e4m3fn."""
    if not tensor.is_floating_point():
        return True
    for part in tensor.detach().reshape(-1).split(FINITE_CHECK_ELEMENTS):
        values = part.float() if part.element_size() == 1 else part
        if not bool(values.sum().isfinite()) and not bool(values.isfinite().all()):
            return False
    return True


def non_finite_tensors(path: Path | str) -> list[str]:
    """The names of the tensors of the safetensors file at ``path`` that hold a NaN or an infinite value, read one at
    a time (never the whole file in memory)."""
    with safe_open(str(path), framework="pt") as opened:
        return [name for name in opened.keys() if not finite(opened.get_tensor(name))]  # noqa: SIM118


class WeightsOrigin(Protocol):
    """Where a pod accepts weights from."""

    def check(self, weights: Weights) -> None:
        """Return if ``weights.uri`` is this origin's URI for ``weights.version`` (lockstep.origin); raise
        RefusedWeights, naming the URI and the allowed location, otherwise."""

    def read(self, weights: Weights) -> VerifiedWeights:
        """The checked bytes of ``weights``, to load outside a transfer group (WeightsDirectory.read)."""


def weights_directory(shared_dir: Path) -> Path:
    """Where the trainer publishes weights in the job's directory ($LOCKSTEP_SHARED_DIR)."""
    return shared_dir / WEIGHTS_DIRECTORY


def refused(weights: Weights, origin: WeightsFiles | TrainerManifest) -> RefusedWeights | None:
    """Why this pod refuses ``weights`` from anywhere but ``origin``, or None (lockstep.origin decides)."""
    problem = origin_problem(weights.uri, weights.version, origin)
    if problem is None:
        return None
    return RefusedWeights(
        f"refusing weights version {weights.version} at {weights.uri}: it {problem}; this pod takes weights only "
        f"from {origin.allowed(weights.version)}"
    )


@dataclass(frozen=True)
class WeightsDirectory:
    """The filesystem backend's origin: files in ``directory`` (the job's weights directory), named so by their
    URI and, once opened, in fact (no symlink or '..' leads out)."""

    directory: Path

    def check(self, weights: Weights) -> None:
        if (refusal := refused(weights, WeightsFiles(PurePosixPath(self.directory)))) is not None:
            raise refusal

    def read(self, weights: Weights) -> VerifiedWeights:
        """The file of ``weights``, opened once and copied into memory while hashed: the caller loads exactly the
        bytes whose digest was checked, whatever happens to the path meanwhile. Raises RefusedWeights (the URI,
        or the opened file, is not in the directory) or DigestMismatch."""
        self.check(weights)
        root = self.directory.resolve()
        source = os.open(local_path(weights), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            opened = Path(os.readlink(f"/proc/self/fd/{source}"))
            if root not in opened.parents or not stat.S_ISREG(os.fstat(source).st_mode):
                raise RefusedWeights(
                    f"refusing weights version {weights.version} at {weights.uri}: it resolves to {opened}, not a "
                    f"file in the job's weights directory {root}, the only place this pod loads weights from"
                )
            return VerifiedWeights.copy(source, weights)
        finally:
            os.close(source)


class VerifiedWeights:
    """A sealed in-memory copy of a weights file whose digest was checked: nothing can change it any more. Another
    process of this pod (vLLM's workers) reads it at ``path`` while it is open."""

    def __init__(self, fd: int, weights: Weights, seconds: float) -> None:
        self.fd = fd
        self.weights = weights
        self.seconds = seconds
        """How long the read, hash and copy took."""

    @classmethod
    def copy(cls, source: int, weights: Weights) -> VerifiedWeights:
        """Copy the open file ``source`` in one pass, hashing as it goes; raise DigestMismatch unless it is
        ``weights.digest``."""
        started = time.monotonic()
        fd = os.memfd_create(f"weights-v{weights.version}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            sha = hashlib.sha256()
            while block := os.read(source, 1 << 20):
                sha.update(block)
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view) :]
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            found = f"sha256:{sha.hexdigest()}"
            if found != weights.digest:
                raise DigestMismatch(
                    f"{weights.uri} has digest {found}, but version {weights.version} was announced as {weights.digest}"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, weights, time.monotonic() - started)

    @property
    def path(self) -> str:
        """Where this pod's other processes open the copy (this process's descriptor, not the file's path)."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> VerifiedWeights:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def digest_of(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            sha.update(block)
    return f"sha256:{sha.hexdigest()}"


RETAIN_SECONDS = 900.0
"""How long a published version stays, whatever is published after it: a new actor starts from the version the
job had committed when its pod was created, and reads it only once its pod has started."""


def publish(
    tensors: Mapping[str, torch.Tensor],
    directory: Path,
    version: int,
    keep: int = 3,
    metadata: Mapping[str, str] | None = None,
) -> Weights:
    """Write ``tensors`` as weights version ``version``, with the header's ``metadata`` (a LoRA adapter's config,
    lockstep_workers.weights.lora); return what to announce (its file, digest and size). Larger elements come first, as
    safetensors orders them, so every tensor is aligned to its element size. As ``publish_layers``."""
    untied = _untied(tensors)
    ordered = {name: untied[name] for name in sorted(untied, key=lambda name: (-untied[name].element_size(), name))}
    return publish_layers(ordered, [ordered], directory, version, keep, metadata)


def publish_layers(
    layout: Mapping[str, torch.Tensor],
    layers: Iterable[Mapping[str, torch.Tensor]],
    directory: Path,
    version: int,
    keep: int = 3,
    metadata: Mapping[str, str] | None = None,
) -> Weights:
    """Write weights version ``version`` whose tensors are ``layout``'s (names in file order, dtypes and shapes: meta
    tensors will do), their data arriving as ``layers`` yields them, in the same order (``write_safetensors``), with
    the header's ``metadata``; return what to announce. The file is hashed as it is written, and on disk (file and
    directory flushed) under its final name before this returns: a crash leaves either the whole version or none
    under that name. A tensor that is not finite raises NonFiniteWeights, naming it, and leaves no file. Older
    versions go once they are neither among the ``keep`` newest nor younger than RETAIN_SECONDS."""
    directory.mkdir(parents=True, exist_ok=True)
    final = version_path(directory, version)
    partial = final.with_name(f".{final.name}.partial")
    try:
        with partial.open("wb") as stream:
            digest = write_safetensors(layout, layers, stream, metadata)
            stream.flush()
            os.fsync(stream.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
    fsync_directory(directory)
    retained_since = time.time() - RETAIN_SECONDS
    for old in sorted(directory.glob("v*.safetensors"))[:-keep]:
        if old.stat().st_mtime < retained_since:
            old.unlink(missing_ok=True)
    return Weights(version=version, uri=final.resolve().as_uri(), digest=digest, bytes=final.stat().st_size)


PUBLISH_BUFFER_BYTES = 2 << 30
"""How many bytes of a version's gathered layers may wait for the publish thread at once (StreamedPublish): a model
up to this size is gathered whole while its file is written in the background; a larger one streams, the gather
waiting for the write, so that host memory holds this much and a layer or two, never the whole model."""


class StreamedPublish:
    """Trainer rank 0's publish of one version, written on a thread of its own (``publish_layers``) from the layers
    its trainer thread hands over (``put``) as it gathers them, at most ``limit`` bytes of them waiting at once
    (always at least one layer). ``result`` waits for the file and returns what to announce, or raises the write's
    error. A failed write drops the layers handed over after it, so that the trainer thread, whose gather is a
    collective of every rank, goes on to its end and learns of the failure from ``result``."""

    def __init__(
        self,
        layout: Mapping[str, torch.Tensor],
        directory: Path,
        version: int,
        keep: int,
        metadata: Mapping[str, str] | None = None,
        limit: int = PUBLISH_BUFFER_BYTES,
    ) -> None:
        self._limit = limit
        self._layers: deque[tuple[Mapping[str, torch.Tensor], int]] = deque()
        self._waiting = 0
        self._closed = self._failed = False
        self._changed = threading.Condition()
        self._outcome: Weights | BaseException | None = None
        self.started = time.time()
        """When the write began (beside the gather of the first layer), in seconds since the epoch."""
        self.seconds: float | None = None
        """How long the write took, from ``started`` (beside the gather) to the file's rename; None until it ended."""
        self._thread = threading.Thread(
            target=self._write, args=(layout, directory, version, keep, metadata), name=f"write-v{version}", daemon=True
        )
        self._thread.start()

    def put(self, layer: Mapping[str, torch.Tensor]) -> None:
        """Hand over the next layer; block while ``limit`` bytes of earlier ones wait."""
        size = sum(t.numel() * t.element_size() for t in layer.values())
        with self._changed:
            self._changed.wait_for(lambda: self._failed or not self._waiting or self._waiting + size <= self._limit)
            if not self._failed:
                self._layers.append((layer, size))
                self._waiting += size
                self._changed.notify_all()

    def close(self) -> None:
        """Every layer was handed over."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def result(self) -> Weights:
        """Wait for the write; return what announces the version, or raise why it failed."""
        self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def _handed_over(self) -> Iterator[Mapping[str, torch.Tensor]]:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._layers) or self._closed)
                if not self._layers:
                    return
                layer, size = self._layers.popleft()
            yield layer
            with self._changed:  # written: its memory may go
                self._waiting -= size
                self._changed.notify_all()

    def _write(
        self, layout: Mapping[str, torch.Tensor], directory: Path, version: int, keep: int, metadata: Any
    ) -> None:
        started = time.monotonic()
        try:
            self._outcome = publish_layers(layout, self._handed_over(), directory, version, keep, metadata)
        except BaseException as error:  # handed to the trainer's thread by ``result``
            self._outcome = error
            with self._changed:
                self._failed = True
                self._layers.clear()
                self._changed.notify_all()
        self.seconds = time.monotonic() - started


class Writable(Protocol):
    def write(self, data: bytes | memoryview, /) -> int: ...


def write_safetensors(
    layout: Mapping[str, torch.Tensor],
    layers: Iterable[Mapping[str, torch.Tensor]],
    stream: Writable,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write ``layout``'s tensors to ``stream`` in the safetensors format (an 8-byte little-endian header length, a
    JSON header of each tensor's dtype, shape and data offsets in ``layout``'s order, then the raw bytes), hashing
    the bytes as they go; return their digest. The data comes from ``layers`` (contiguous CPU tensors, no two
    sharing storage), which must yield exactly ``layout``'s tensors in its order: a layer is written, and may be
    freed, before the next is asked for. ``metadata`` (strings to strings) is the header's ``__metadata__``, which
    the digest covers as it covers the whole header. Raises ValueError before writing anything when a tensor would
    not be aligned to its element size, and when the data does not match the header; NonFiniteWeights, naming the
    tensor, before writing one that holds a NaN or an infinite value."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata maps strings to strings")
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for name, tensor in layout.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which the safetensors format cannot hold")
        if offset % tensor.element_size():
            raise ValueError(f"tensor {name} would start at byte {offset}, not aligned to its {tensor.dtype} elements")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    sha = hashlib.sha256()
    for chunk in (len(encoded).to_bytes(8, "little"), encoded):
        sha.update(chunk)
        stream.write(chunk)
    expected = iter(layout.items())
    for layer in layers:
        for name, tensor in layer.items():
            want_name, want = next(expected, (None, None))
            if want is None or name != want_name or tensor.dtype != want.dtype or tensor.shape != want.shape:
                raise ValueError(
                    f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} arrived where the header has {want_name}"
                )
            if not finite(tensor):
                raise NonFiniteWeights(
                    f"tensor {name} holds NaN or infinite values (a diverged step): the version is not published"
                )
            data = tensor.detach().reshape(-1).view(torch.uint8).numpy().data
            sha.update(data)
            stream.write(data)
    missing = [name for name, _ in expected]
    if missing:
        raise ValueError(f"the header's tensors {missing[:3]} (of {len(missing)}) never arrived")
    return f"sha256:{sha.hexdigest()}"


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""torch's dtypes → the safetensors format's names (the one table of them; lockstep_workers.weights.transfer reads it
too)."""


def fsync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename in it) to disk."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class PublishFailed(RuntimeError):
    """A background publish failed; raised on the trainer's path at its next step, or at the end of training."""


class Publisher:
    """Trainer rank 0's publishes, each on a thread of its own, at most one at a time: a publish (write, hash,
    flush, rename, announce) runs while the next step computes. ``wait`` blocks until the one in flight has
    finished and raises its error, if it failed, as PublishFailed: the next call to ``wait`` or ``start`` after a
    failure raises it, so no error is lost."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._version: int | None = None
        self._error: BaseException | None = None

    def start(self, version: int, work: Callable[[], object]) -> float:
        """Wait for the publish in flight (``wait``), then run ``work``, the publish of ``version``, in the
        background; return the seconds waited."""
        waited = self.wait()
        self._version = version
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"publish-v{version}", daemon=True)
        self._thread.start()
        return waited

    def wait(self) -> float:
        """Block until no publish is in flight; return the seconds waited. Raise PublishFailed if it failed."""
        started = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise PublishFailed(
                f"publishing weights version {self._version} failed: {error}; the trainer stops, and a restarted "
                "one resumes from the newest version on disk"
            ) from error
        return time.monotonic() - started

    def wait_for(self, version: int) -> float:
        """``wait`` if the publish in flight is of ``version`` or older (the actors cannot serve it before it is
        announced); return the seconds waited."""
        if self._thread is not None and self._version is not None and self._version <= version:
            return self.wait()
        return 0.0

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as error:  # handed to the trainer's thread by ``wait``
            logger.exception("publishing weights version %s failed", self._version)
            self._error = error


def published(directory: Path, version: int) -> Weights:
    """What announces weights version ``version``, published in ``directory``: its file, that file's digest and
    its size."""
    path = version_path(directory, version)
    return Weights(version=version, uri=path.resolve().as_uri(), digest=digest_of(path), bytes=path.stat().st_size)


def version_path(directory: Path, version: int) -> Path:
    """Where weights version ``version`` is published in ``directory``."""
    return directory / f"v{version:06d}.safetensors"


def newest_version(directory: Path) -> int | None:
    """The newest version published in ``directory``, if any."""
    versions = [int(path.stem.removeprefix("v")) for path in directory.glob("v*.safetensors")]
    return max(versions, default=None)


def _untied(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once, under the first name that uses it (tied embeddings are written as Hugging Face checkpoints
    write them: the lm_head falls away); views of one storage at other places or shapes (an expert's slice of a
    fused tensor) are tensors of their own."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    result = {}
    for name, tensor in tensors.items():
        where = (tensor.data_ptr(), tuple(tensor.shape))
        if where not in seen:
            seen.add(where)
            result[name] = tensor.detach().contiguous().cpu()
    return result


def local_path(weights: Weights) -> Path:
    """The local file a ``file://`` URI names (percent-escapes decoded, as ``Path.as_uri`` writes them)."""
    parsed = urlparse(weights.uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ValueError(f"the filesystem transport reads local file:// URIs, not {weights.uri!r}")
    return Path(unquote(parsed.path))


def verified_path(weights: Weights) -> Path:
    """The file of ``weights``, after checking its digest."""
    path = local_path(weights)
    found = digest_of(path)
    if found != weights.digest:
        raise DigestMismatch(
            f"{path} has digest {found}, but version {weights.version} was announced as {weights.digest}"
        )
    return path


def tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    yield from load_file(str(path)).items()
