"""The filesystem weight transport: safetensors files on a volume shared by the trainer and the actors.

The trainer publishes version N as ``v000N.safetensors``: written to a temporary name, renamed
into place (atomic), announced with its sha256 (``published``); older versions beyond ``keep`` are removed.
An actor opens a version only from its job's own weights directory (``WeightsDirectory``), reads it once into a
sealed copy in memory while hashing it, and loads that copy only if its digest is the one it was told.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load_file, save_file

from lockstep.origin import WEIGHTS_DIRECTORY, TrainerManifest, WeightsFiles, origin_problem
from lockstep.protocol import Weights


class DigestMismatch(OSError):
    """The file is not the one that was announced."""


class RefusedWeights(ValueError):
    """Weights announced at a URI outside the job's own weights: never loaded."""


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

    def __init__(self, fd: int, weights: Weights) -> None:
        self.fd = fd
        self.weights = weights

    @classmethod
    def copy(cls, source: int, weights: Weights) -> VerifiedWeights:
        """Copy the open file ``source`` in one pass, hashing as it goes; raise DigestMismatch unless it is
        ``weights.digest``."""
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
        return cls(fd, weights)

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


def publish(tensors: Mapping[str, torch.Tensor], directory: Path, version: int, keep: int = 3) -> Weights:
    """Write ``tensors`` as weights version ``version``; return what to announce. Older versions go once they are
    neither among the ``keep`` newest nor younger than RETAIN_SECONDS."""
    directory.mkdir(parents=True, exist_ok=True)
    final = version_path(directory, version)
    partial = final.with_name(f".{final.name}.partial")
    save_file(_untied(tensors), str(partial))
    os.replace(partial, final)
    retained_since = time.time() - RETAIN_SECONDS
    for old in sorted(directory.glob("v*.safetensors"))[:-keep]:
        if old.stat().st_mtime < retained_since:
            old.unlink(missing_ok=True)
    return published(directory, version)


def published(directory: Path, version: int) -> Weights:
    """What announces weights version ``version``, published in ``directory``: its file and that file's digest."""
    path = version_path(directory, version)
    return Weights(version=version, uri=path.resolve().as_uri(), digest=digest_of(path))


def version_path(directory: Path, version: int) -> Path:
    """Where weights version ``version`` is published in ``directory``."""
    return directory / f"v{version:06d}.safetensors"


def newest_version(directory: Path) -> int | None:
    """The newest version published in ``directory``, if any."""
    versions = [int(path.stem.removeprefix("v")) for path in directory.glob("v*.safetensors")]
    return max(versions, default=None)


def _untied(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each storage once, under the first name that uses it (tied embeddings are written as Hugging Face
    checkpoints write them: the lm_head falls away)."""
    seen: set[int] = set()
    result = {}
    for name, tensor in tensors.items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
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
