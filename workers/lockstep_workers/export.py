"""The trained model, servable: a published weights version (lockstep_workers.weights) written as a Hugging Face
directory that transformers, vLLM (`vllm serve <dir>`) and PEFT load as it is. Trainer rank 0 writes one at the end
of a successful job and every spec.output.everySteps (lockstep_workers.trainer); `lockstep export` writes one from any
published version, offline.

A full version becomes the base model's config (its dtype the written one), its generation config, its tokenizer files
with the chat template, and safetensors shards in spec.output.dtype (tied embeddings stored once, as Hugging Face
checkpoints store them). A LoRA version becomes PEFT's adapter directory (adapter_config.json, from the version's
header, and adapter_model.safetensors) with the tokenizer files, and, asked for, the merged model in merged/. Each
directory is written under a hidden temporary name beside its final one, flushed, then renamed: a half-written
directory is never under the final name. Every file gets the mode a new file gets in this process (0644 under the
usual umask): transformers writes its safetensors shards 0600, which a serving pod running as another user of the
same volume could not read.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from lockstep.api import DType
from lockstep_workers.weights import lora
from lockstep_workers.weights.files import digest_of, fsync_directory, tensors, version_path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED = "merged"
"""The subdirectory of a LoRA job's write that holds the merged model."""


def output_path(directory: Path, version: int) -> Path:
    """Where spec.output writes ``version``: v<version, 6 digits> under spec.output.path."""
    return directory / f"v{version:06d}"


def directory_digest(directory: Path) -> str:
    """sha256:<hex> over ``directory``: one line "<relative path> <file's sha256>" per file, sorted by path."""
    lines = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        lines.append(f"{path.relative_to(directory).as_posix()} {digest_of(path).removeprefix('sha256:')}\n")
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def write(version_file: Path, base_model: str, destination: Path, dtype: DType, merged: bool = False) -> str:
    """Write the published version at ``version_file`` (of the base model at ``base_model``) as a Hugging Face
    directory at ``destination``, which must not exist, in ``dtype`` (auto: the base checkpoint's); return its
    digest. ``merged``: a LoRA version also gets the merged model in merged/ (ignored for full weights)."""
    if destination.exists():
        raise FileExistsError(f"{destination} exists: choose a new directory (nothing was written)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(f"{_partial_prefix(destination)}{uuid.uuid4().hex[:8]}")
    try:
        adapter = _adapter_config(version_file)
        if adapter is None:
            _write_full(dict(tensors(version_file)), base_model, partial, dtype)
        else:
            _write_adapter(version_file, adapter, base_model, partial, dtype, merged)
        _readable(partial, 0o666 & ~_umask())
        _fsync_tree(partial)
        os.rename(partial, destination)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fsync_directory(destination.parent)
    return directory_digest(destination)


def write_version(
    weights_dir: Path, version: int, base_model: str, output: Path, dtype: DType, merged: bool
) -> tuple[Path, str]:
    """spec.output's write of ``version`` (published in ``weights_dir``) under ``output``; return its directory and
    digest. A directory already there is that version's, written whole by an earlier trainer of the job: it is kept;
    a temporary one of that version, left by a trainer that stopped while it wrote, is removed."""
    destination = output_path(output, version)
    if destination.exists():
        return destination, directory_digest(destination)
    for left in output.glob(f"{_partial_prefix(destination)}*"):
        shutil.rmtree(left, ignore_errors=True)
    return destination, write(version_path(weights_dir, version), base_model, destination, dtype, merged)


def _partial_prefix(destination: Path) -> str:
    """The name of a temporary directory of ``destination``, but its random suffix."""
    return f".{destination.name}.partial-"


def serve_command(directory: Path) -> str:
    """One command that serves the model written at ``directory``: the merged model when there is one, else the
    adapter on its base (LoRA), else the directory itself."""
    if (directory / MERGED).is_dir():
        return f"vllm serve {directory / MERGED}"
    if (directory / ADAPTER_CONFIG).is_file():
        base = json.loads((directory / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
        return f"vllm serve {base} --enable-lora --lora-modules trained={directory}"
    return f"vllm serve {directory}"


def _adapter_config(version_file: Path) -> dict[str, Any] | None:
    """A LoRA version's adapter config, from its header; None for full weights."""
    try:
        return lora.adapter_config_of(version_file)
    except ValueError:
        return None


def _torch_dtype(dtype: DType, config: Any) -> torch.dtype:
    """``dtype`` as torch's; auto: the checkpoint's (its config's dtype, float32 when it names none)."""
    if dtype is not DType.AUTO:
        chosen: torch.dtype = getattr(torch, dtype.value)
        return chosen
    found = config.dtype
    return found if isinstance(found, torch.dtype) else getattr(torch, found or "float32")


def _write_full(state: dict[str, torch.Tensor], base_model: str, directory: Path, dtype: DType) -> None:
    """The base model's architecture with ``state`` (a full version, in the checkpoint's names) as its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_model)
    chosen = _torch_dtype(dtype, config)
    with torch.device("meta"):  # no second copy of the weights: the version's tensors become the parameters
        model = AutoModelForCausalLM.from_config(config, dtype=chosen)
    loaded = model.load_state_dict({name: t.to(chosen) for name, t in state.items()}, strict=False, assign=True)
    model.tie_weights()
    if loaded.unexpected_keys:
        raise ValueError(f"the version does not fit the model at {base_model}: {sorted(loaded.unexpected_keys)[:5]}")
    missing = sorted(name for name, p in model.state_dict().items() if p.is_meta)
    if missing:
        raise ValueError(f"the version lacks tensors of the model at {base_model}: {missing[:5]}")
    _save(model, base_model, directory)


def _write_adapter(
    version_file: Path, adapter: dict[str, Any], base_model: str, directory: Path, dtype: DType, merged: bool
) -> None:
    """PEFT's adapter directory of a LoRA version, with the base's tokenizer files; ``merged``: and the merged model
    in merged/."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    chosen = _torch_dtype(dtype, AutoConfig.from_pretrained(base_model))
    directory.mkdir(parents=True)
    (directory / ADAPTER_CONFIG).write_text(json.dumps({**adapter, "base_model_name_or_path": base_model}, indent=2))
    weights = {name: tensor.to(chosen).contiguous() for name, tensor in tensors(version_file)}
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    _save_tokenizer(base_model, directory)
    if merged:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)  # merged in fp32, then cast
        model = PeftModel.from_pretrained(base, str(directory)).merge_and_unload()
        _save(model.to(chosen), base_model, directory / MERGED)


def _save(model: Any, base_model: str, directory: Path) -> None:
    """``model`` (safetensors shards and its config), the base's generation config and tokenizer files."""
    from transformers import GenerationConfig

    with contextlib.suppress(OSError):  # without the base's generation_config.json, the one from its config stays
        model.generation_config = GenerationConfig.from_pretrained(base_model)
    model.save_pretrained(directory)
    _save_tokenizer(base_model, directory)


def _save_tokenizer(base_model: str, directory: Path) -> None:
    """The base's tokenizer files, its chat template included."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base_model).save_pretrained(directory)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread); 0o022 where /proc does not
    say."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _readable(directory: Path, mode: int) -> None:
    """Give every file under ``directory`` the one ``mode``."""
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def _fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and the directories, to disk (before the rename that shows them)."""
    for path in directory.rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        else:
            fsync_directory(path)
    fsync_directory(directory)


def main(argv: list[str] | None = None) -> int:
    """``lockstep export``: write a published version as a servable Hugging Face directory, offline."""
    parser = argparse.ArgumentParser(
        prog="lockstep export",
        description="Write a published weights version (v<N>.safetensors in a job's weights directory) as a Hugging "
        "Face directory that `vllm serve` and transformers load as it is (a LoRA version: PEFT's adapter directory).",
    )
    parser.add_argument("--model", required=True, help="the job's base model: spec.model.uri, as a local directory")
    parser.add_argument("--weights", required=True, type=Path, help="a v<N>.safetensors file, or the directory of them")
    parser.add_argument("--version", type=int, help="with a directory for --weights: the version (default: the newest)")
    parser.add_argument("--output", required=True, type=Path, help="the directory to write; it must not exist")
    parser.add_argument("--dtype", default=DType.BFLOAT16.value, choices=[d.value for d in DType])
    parser.add_argument("--merged", action="store_true", help="a LoRA version: also write the merged model in merged/")
    options = parser.parse_args(argv)
    version_file = _version_file(options.weights, options.version, parser)
    digest = write(version_file, options.model, options.output, DType(options.dtype), options.merged)
    print(f"wrote {version_file.name} as {options.output} ({digest}); serve it with: {serve_command(options.output)}")
    return 0


def _version_file(weights: Path, version: int | None, parser: argparse.ArgumentParser) -> Path:
    """The version file --weights and --version name; exits through ``parser`` naming what is missing."""
    from lockstep_workers.weights.files import newest_version

    if weights.is_file():
        return weights
    if not weights.is_dir():
        parser.error(f"--weights {weights}: no such file or directory")
    chosen = version if version is not None else newest_version(weights)
    if chosen is None or not version_path(weights, chosen).is_file():
        parser.error(f"--weights {weights}: has no version {chosen if chosen is not None else '(none published)'}")
    return version_path(weights, chosen)
