"""The load check with tensor parallelism (issue 36's groups split one engine's layers over pods): each vLLM worker
checks the shard it holds. On a real engine of two tensor-parallel workers (vLLM's CPU build, its multiprocessing
executor on this host, as a group's pods run it across nodes), and on the shard arithmetic of each kind of
module vLLM shards, replicated key and value heads included."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lockstep_workers.load_check import Shard, shard_of

PROMPT = [1, 10, 11, 12]


@dataclass
class ShardIndices:
    org_vocab_start_index: int
    org_vocab_end_index: int


@dataclass
class Sharded:
    """The attributes vLLM's parallel modules carry (LinearBase, VocabParallelEmbedding)."""

    tp_rank: int
    tp_size: int
    input_size_per_partition: int | None = None
    output_partition_sizes: list[int] | None = None
    shard_indices: ShardIndices | None = None


def test_each_rank_holds_its_rows_of_a_column_parallel_module_part_by_part() -> None:
    """gate_up_proj: two published tensors of 512 rows, 256 of each on each of 2 ranks."""
    shapes = [(512, 128), (512, 128)]
    assert [shard_of(Sharded(rank, 2, 128, [256, 256]), shapes) for rank in (0, 1)] == [
        Shard([(0, 256), (0, 256)], (0, 128)),
        Shard([(256, 512), (256, 512)], (0, 128)),
    ]


def test_ranks_share_a_key_and_value_head_when_there_are_fewer_than_ranks() -> None:
    """qkv_proj with 8 query heads and 2 key/value heads of 64 over 4 ranks: vLLM gives ranks 0-1 the first key
    and value head, ranks 2-3 the second (num_kv_head_replicas 2)."""
    shapes = [(512, 512), (128, 512), (128, 512)]
    shards = [shard_of(Sharded(rank, 4, 512, [128, 64, 64]), shapes).rows for rank in range(4)]
    assert shards == [
        [(0, 128), (0, 64), (0, 64)],
        [(128, 256), (0, 64), (0, 64)],
        [(256, 384), (64, 128), (64, 128)],
        [(384, 512), (64, 128), (64, 128)],
    ]


def test_a_row_parallel_module_holds_its_columns_and_every_row() -> None:
    assert shard_of(Sharded(1, 2, input_size_per_partition=256), [(128, 512)]) == Shard([(0, 128)], (256, 512))


def test_a_vocabulary_parallel_embedding_holds_its_rows_of_the_vocabulary() -> None:
    module = Sharded(1, 2, shard_indices=ShardIndices(128, 256))
    assert shard_of(module, [(256, 64)]) == Shard([(128, 256)], (0, 64))


def test_a_module_of_one_rank_holds_everything() -> None:
    assert shard_of(object(), [(12, 8), (4, 8)]) == Shard([(0, 12), (0, 4)], (0, 8))


def _trainer_logprobs(model_dir: Path, tokens: list[int]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_two_tensor_parallel_workers_each_load_and_check_their_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied tiny Llama of 4 heads over 2 workers: the reload of a new version is checked on both shards, every
    published tensor covered; the engine then serves the new version's logprobs; and a check against the old
    version names a module."""
    import torch
    from vllm import LLM, SamplingParams

    from lockstep_workers.tiny_model import create_tiny_llama

    # Two workers on one host: vLLM's CPU build binds each to its own core (on two nodes each has its own).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    old = create_tiny_llama(tmp_path / "v0", hidden_size=256, tie_word_embeddings=True)
    new = create_tiny_llama(tmp_path / "v1", hidden_size=256, tie_word_embeddings=True, seed=1)
    llm = LLM(
        model=str(old),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        worker_extension_cls="lockstep_workers.vllm_extension.WeightReloader",
    )
    try:
        reports = llm.collective_rpc("lockstep_reload", args=(str(new / "model.safetensors"),))
        assert reports == [{"modules": 10, "parameters": 5, "unchecked": []}] * 2, "each shard, every tensor"
        greedy = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
        completion = llm.generate({"prompt_token_ids": PROMPT}, greedy)[0].outputs[0]
        tokens = list(completion.token_ids)
        served = torch.tensor(
            [candidates[token].logprob for token, candidates in zip(tokens, completion.logprobs or [], strict=True)]
        )
        assert torch.allclose(served, _trainer_logprobs(new, tokens), atol=1e-4)
        assert not torch.allclose(served, _trainer_logprobs(old, tokens), atol=1e-2), "the versions differ"
        with pytest.raises(Exception, match=r"model\.embed_tokens: its weight is not the published"):
            llm.collective_rpc("lockstep_check", args=(str(old / "model.safetensors"),))
    finally:
        llm.llm_engine.engine_core.shutdown()
