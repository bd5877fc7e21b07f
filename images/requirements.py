"""Print the requirements of one of the images' Python environments, one a line, from pyproject.toml.

``operator``: the operator's runtime dependencies (no torch, no vLLM). ``workers``: those and the ``workers``
extra (torch, transformers, tokenizers, safetensors, pyarrow). The Containerfiles install them with
``-c requirements/constraints.txt``, so every package gets the version pinned there.

Standard library only: it runs inside the image builds, before anything is installed.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, environment: str) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    listed: list[str] = project["dependencies"]
    if environment == "workers":
        listed = listed + project["optional-dependencies"]["workers"]
    elif environment != "operator":
        raise SystemExit(f"unknown environment {environment!r}: operator or workers")
    return listed


if __name__ == "__main__":
    pyproject, environment = Path(sys.argv[1]), sys.argv[2]
    print("\n".join(requirements(pyproject, environment)))
