"""Where a job's weights may come from (docs/barrier-protocol.md, Transports): the one check of an announced URI,
made by the operator before it opens a barrier and by each pod's agent before it reads anything.

A job's weights come from its own trainer only: with the filesystem backend a file in the job's weights
directory on the shared volume (``WeightsFiles``), with a collective one trainer rank 0's manifest of the
version (``TrainerManifest``). Whoever can forge an announcement supplies the digest too, so the URI alone
decides. The check is on the text of the URI; the agent also checks the file it opens (symlinks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

WEIGHTS_DIRECTORY = "weights"
"""Where the trainer publishes weights in the job's directory ($LOCKSTEP_SHARED_DIR/weights)."""


@dataclass(frozen=True)
class WeightsFiles:
    """The filesystem backend's origin: files under the job's weights directory, as its pods see it."""

    directory: PurePosixPath

    def allowed(self, version: int) -> str:
        """The allowed URIs, in words."""
        return f"files in its weights directory, file://{self.directory}/<file>"


@dataclass(frozen=True)
class TrainerManifest:
    """The collective backends' origin: trainer rank 0's manifest server, at ``host``:``port``."""

    host: str
    port: int

    def uri(self, version: int) -> str:
        """The only URI of weights version ``version``."""
        return f"http://{self.host}:{self.port}/weights/{version}"

    def allowed(self, version: int) -> str:
        """The allowed URI, in words."""
        return f"its trainer rank 0's manifest of that version, {self.uri(version)}"


WeightsOrigin = WeightsFiles | TrainerManifest


def origin_problem(uri: str, version: int, origin: WeightsOrigin) -> str | None:
    """Why ``uri`` is not where ``origin`` publishes weights version ``version``, or None when it is.

    Files: exactly ``file://`` with an empty host, then an absolute path (percent-escapes decoded) with no
    ``.``/``..`` segment, no query or fragment, under ``origin.directory``. Manifests: exactly ``origin.uri``.
    """
    if isinstance(origin, TrainerManifest):
        return None if uri == origin.uri(version) else "is not its trainer rank 0's manifest of that version"
    if not uri.startswith("file:///"):
        return "is not a file:/// URI (a local file, no host)"
    if "?" in uri or "#" in uri:
        return "has a query or a fragment"
    path = unquote(urlsplit(uri).path)
    segments = path.split("/")[1:]
    if any(segment in (".", "..") for segment in segments) or "\0" in path:
        return "has a '.', '..' or NUL in its path"
    if origin.directory not in PurePosixPath(path).parents:
        return "names a file outside the job's weights directory"
    return None
