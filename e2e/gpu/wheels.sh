#!/usr/bin/env bash
# The project's small Python dependencies that a GPU machine's image lacks (the trainer's code imports pydantic
# through lockstep.api), as wheels for its Python 3.12 on x86-64, in out/gpu-wheels: run here, where pip reaches
# PyPI; e2e/gpu/check.sh installs them there. Versions from requirements/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p out/gpu-wheels
for name in pydantic pydantic_core annotated-types typing-inspection; do
  pin=$(grep -i "^${name}==" requirements/constraints.txt)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d out/gpu-wheels "$pin"
done
ls out/gpu-wheels
