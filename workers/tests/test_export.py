"""spec.output and `lockstep export` (lockstep_workers.export): a published version written as a Hugging Face
directory loads in transformers with the trainer's logprobs (a tied tiny Llama; bf16 by default), a LoRA version as
PEFT's adapter directory and its merged model; the real pretrained model (SmolLM2-135M-Instruct, tied embeddings)
round-trips with its tokenizer, chat template and generation config; a write is atomic and a trainer's rewrite of a
version keeps the directory there."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.api import DType, LoraSettings, Output
from lockstep_workers import export
from lockstep_workers.tiny_model import CHAT_TEMPLATE, CHAT_WORDS, create_tiny_llama
from lockstep_workers.trainer.output import output_due, write_output
from lockstep_workers.trainer.pod import PodEnvironment
from lockstep_workers.weights import lora
from lockstep_workers.weights.files import publish, version_path, weights_directory

TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9]])


def trained(base: Path) -> Any:
    """The base model with every weight moved: what a trainer's version holds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return model


def logprobs(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(TOKENS).logits.float(), dim=-1)


def load(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tied") / "base"
    return create_tiny_llama(directory, tie_word_embeddings=True, words=CHAT_WORDS, chat_template=CHAT_TEMPLATE)


def test_the_trainers_write_loads_in_transformers_with_its_logprobs_and_is_reported(tied: Path, tmp_path: Path) -> None:
    model = trained(tied)
    env = PodEnvironment(0, 1, [], tmp_path / "job", None, None, None, 0)
    publish(model.state_dict(), env.weights_dir, version=7)
    output = Output(path=str(tmp_path / "models"), dtype=DType.FLOAT32)
    (tmp_path / "models" / ".v000007.partial-0badc0de").mkdir(parents=True)  # a trainer killed as it wrote
    written = write_output(env, output, str(tied), 7, (6, 0.25))
    assert (written.path, written.version, written.step) == (str(tmp_path / "models" / "v000007"), 7, 7)
    assert (written.eval_version, written.eval_reward) == (6, 0.25)
    assert written.digest == export.directory_digest(Path(written.path))
    exported = load(Path(written.path))
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr(), "still tied"
    torch.testing.assert_close(logprobs(exported), logprobs(model), rtol=0, atol=0)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["v000007"], "no temporary directory left"
    again = write_output(env, output, str(tied), 7, None)  # a restarted trainer: the whole directory is kept
    assert again.digest == written.digest and again.eval_reward is None and again.eval_version is None


def test_bfloat16_is_the_default_and_close_to_the_trainers_logprobs(tied: Path, tmp_path: Path) -> None:
    model = trained(tied)
    publish(model.state_dict(), tmp_path / "weights", version=1)
    destination = tmp_path / "out"
    export.write(version_path(tmp_path / "weights", 1), str(tied), destination, Output(path="/x").dtype)
    exported = load(destination)
    assert exported.dtype == torch.bfloat16
    assert json.loads((destination / "config.json").read_text())["dtype"] == "bfloat16"
    assert (logprobs(exported) - logprobs(model)).abs().max() < 0.1


def test_every_written_file_has_the_mode_a_new_file_gets(tied: Path, tmp_path: Path) -> None:
    """Issue 46 item 7: model.safetensors was 0600 (transformers' shard writer) and the others 0644, so a serving pod
    running as another user of the volume could not read the weights."""
    publish(trained(tied).state_dict(), tmp_path / "weights", version=1)
    export.write(version_path(tmp_path / "weights", 1), str(tied), tmp_path / "out", DType.FLOAT32)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~export._umask())}, modes
    current = os.umask(0o022)
    os.umask(current)
    assert export._umask() == current, "the process's umask, read without changing it"


def test_a_failed_write_leaves_nothing_and_an_existing_directory_is_never_overwritten(
    tied: Path, tmp_path: Path
) -> None:
    model = trained(tied)
    publish(model.state_dict(), tmp_path / "weights", version=1)
    version = version_path(tmp_path / "weights", 1)
    with pytest.raises(OSError):
        export.write(version, str(tmp_path / "no-such-model"), tmp_path / "out" / "v000001", DType.BFLOAT16)
    assert list((tmp_path / "out").iterdir()) == []
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="choose a new directory"):
        export.write(version, str(tied), tmp_path / "taken", DType.BFLOAT16)


def test_a_lora_version_is_pefts_adapter_directory_and_its_merged_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = create_tiny_llama(tmp_path / "base", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    adapter = lora.adapter_config(LoraSettings(rank=4), model)
    lora.inject(model, adapter)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    adapter_state = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    publish(lora.file_names(adapter_state), tmp_path / "w", version=2, metadata=lora.adapter_metadata(adapter))
    destination = tmp_path / "out"
    export.write(version_path(tmp_path / "w", 2), str(base), destination, DType.FLOAT32, merged=True)
    assert {export.ADAPTER_CONFIG, export.ADAPTER_WEIGHTS, export.MERGED} <= {p.name for p in destination.iterdir()}
    assert json.loads((destination / export.ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(base)
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base_model, str(destination)).eval()
    torch.testing.assert_close(logprobs(peft_model), logprobs(model), rtol=0, atol=0)
    torch.testing.assert_close(logprobs(load(destination / export.MERGED)), logprobs(model), rtol=1e-5, atol=1e-5)
    assert export.serve_command(destination) == f"vllm serve {destination / export.MERGED}"
    (destination / export.MERGED).rename(tmp_path / "elsewhere")
    assert export.serve_command(destination) == f"vllm serve {base} --enable-lora --lora-modules trained={destination}"


def test_the_real_model_round_trips_with_its_tokenizer_chat_template_and_generation_config(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct (tied embeddings): its own weights, published as a trainer publishes and exported in
    its dtype (auto), are the model again, its head tied and written once; `lockstep export` names the command
    that serves it."""
    from safetensors import safe_open
    from transformers import AutoTokenizer, GenerationConfig

    from lockstep.cli import main
    from lockstep_e2e import real_model

    base = real_model.ensure()
    model = load(base)
    publish(model.state_dict(), weights_directory(tmp_path), version=1)
    destination = tmp_path / "exported"
    with pytest.raises(SystemExit) as exited:
        main(["export", f"--model={base}", f"--weights={weights_directory(tmp_path)}", f"--output={destination}",
              "--dtype=auto"])  # fmt: skip
    assert exited.value.code == 0
    torch.testing.assert_close(logprobs(load(destination)), logprobs(model), rtol=0, atol=0)
    with safe_open(str(next(destination.glob("*.safetensors"))), framework="pt") as opened:
        assert "lm_head.weight" not in set(opened.keys()), "tied embeddings are written once"
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    ours, theirs = AutoTokenizer.from_pretrained(destination), AutoTokenizer.from_pretrained(base)
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>")
    assert GenerationConfig.from_pretrained(destination).to_dict() == GenerationConfig.from_pretrained(base).to_dict()


@pytest.mark.parametrize(
    ("steps", "every", "due"), [(5, 0, [5]), (6, 2, [2, 4, 6]), (7, 3, [3, 6, 7]), (1, 1, [1]), (4, 9, [4])]
)
def test_the_output_is_written_at_the_last_step_and_every_k(steps: int, every: int, due: list[int]) -> None:
    assert [step for step in range(1, steps + 1) if output_due(step, steps, every)] == due
