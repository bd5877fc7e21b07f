"""The filesystem weight transport: safetensors files on a volume shared by the trainer and the actors.

The trainer publishes version N as ``v000N.safetensors``: written to a temporary name, renamed
into place (atomic), announced with its sha256 (``published``); older versions beyond ``keep`` are removed.
An actor opens a version only from its job's own weights directory (``WeightsDirectory``), and only after
checking the digest it was told.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load_file, save_file

from lockstep.protocol import Weights


class DigestMismatch(OSError):
    """The file is not the one that was announced."""


class RefusedWeights(ValueError):
    """Weights announced at a URI outside the job's own weights: never loaded."""


class WeightsOrigin(Protocol):
    """Where a pod accepts weights from."""

    def check(self, weights: Weights) -> None:
        """Return if ``weights.uri`` is this origin's URI for ``weights.version``; raise RefusedWeights, naming
        the URI and the allowed location, otherwise."""


def weights_directory(shared_dir: Path) -> Path:
    """Where the trainer publishes weights in the job's directory ($LOCKSTEP_SHARED_DIR)."""
    return shared_dir / "weights"


@dataclass(frozen=True)
class WeightsDirectory:
    """The filesystem backend's origin: files that resolve (after symlinks and '..') inside ``directory``."""

    directory: Path

    def check(self, weights: Weights) -> None:
        root = self.directory.resolve()
        try:
            path = local_path(weights).resolve()
        except ValueError as error:
            raise RefusedWeights(f"{error}; weights are accepted only from files in {root}") from error
        if root not in path.parents:
            raise RefusedWeights(
                f"refusing weights version {weights.version} at {weights.uri}: it resolves to {path}, outside the "
                f"job's weights directory {root}, the only place this pod loads weights from"
            )


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
