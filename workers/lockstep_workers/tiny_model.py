"""Tiny random causal LMs for tests and the local demo: a real Llama architecture with a
real (word-level) tokenizer, small enough for vLLM and torch on a CPU. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.api import VllmSettings

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
"""A chat template for a word-level tokenizer: ``<s> user : what is two plus two ? assistant :``. Its words
(the roles and ``:``) must be in the vocabulary."""
CHAT_WORDS = ("system", "user", "assistant", ":")


def vocabulary(size: int, words: Sequence[str] = ()) -> dict[str, int]:
    """Special tokens first, then ``words``, then the words ``w0``, ``w1``, ... up to ``size`` entries."""
    named = [*SPECIAL_TOKENS, *words]
    everything = [*named, *(f"w{i}" for i in range(size - len(named)))]
    return {word: index for index, word in enumerate(everything)}


def create_tiny_llama(
    directory: Path,
    *,
    vocab_size: int = 256,
    hidden_size: int = 128,
    layers: int = 2,
    intermediate_size: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    head_scale: float = 1.0,
    tie_word_embeddings: bool = False,
    words: Sequence[str] = (),
    chat_template: str | None = None,
) -> Path:
    """Write a random Llama (config, safetensors weights, tokenizer) to ``directory`` and return it.

    head_dim is 64: the CPU attention kernel rejects smaller heads. The MLP is ``intermediate_size`` wide (twice
    ``hidden_size`` unless given). ``head_scale`` multiplies the lm_head (the embeddings too, when tied). The
    vocabulary holds ``words`` (vocabulary); the tokenizer has ``chat_template`` if given.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    head_dim = 64
    heads = hidden_size // head_dim
    vocab = vocabulary(vocab_size, words)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)  # > 1: peakier logits, like a trained model's
    model = model.to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory, vocab, chat_template)
    return directory


def save_tokenizer(directory: Path, vocab: dict[str, int], chat_template: str | None = None) -> None:
    """Write a word-level tokenizer of ``vocab`` (vocabulary) to ``directory``: whitespace-split words, ``<unk>``
    for any other, ``<s>`` and ``</s>`` as BOS and EOS, and ``chat_template`` if given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=chat_template,
    ).save_pretrained(directory)


def cpu_vllm_settings() -> VllmSettings:
    """The default ParityPolicy's locked vLLM settings, in fp32 on this CPU (for the tests and benchmarks that
    serve these models with the real actor)."""
    from lockstep.api import VllmSettings
    from lockstep.parity import default_policy

    return VllmSettings(
        **{
            **default_policy().spec.vllm.model_dump(),
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 512,
            "gpu_memory_utilization": 0.2,
            "seed": 0,
        }
    )
