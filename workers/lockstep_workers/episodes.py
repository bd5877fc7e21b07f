"""Rollout functions (RLJob spec.trainer.rollout.function): how one sample is taken from the actors, in one turn or
many.

A rollout function is ``async def function(row, prompt_token_ids, client) -> Episode``:

- ``row``: the sample's dataset row (spec.trainer.dataset), with ``prompt_token_ids`` added (a prompt source's
  prompts have only that);
- ``prompt_token_ids``: the prompt, as the policy sees it;
- ``client.generate(token_ids, sampling)``: one policy turn from the actors, continuing ``token_ids`` (the whole
  conversation so far); ``sampling`` adds vLLM sampling fields (max_tokens, stop, ...) to the job's, but may not
  change its temperature or top_p, which the trainer applies to its own logprobs;
- it returns an ``Episode``: every token after the prompt, the policy's and those the environment inserted (tool
  output, a user turn), with the rollout engine's logprob of each policy token and a mask of which tokens the
  policy produced. Environment tokens stay out of the loss; they are context for the policy tokens after them,
  and part of the completion the reward scores.

The default, ``single_turn``, is one ``generate`` on the prompt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lockstep_workers.rollout.record import Rollout

LOCKED_SAMPLING = ("temperature", "top_p")
"""Sampling fields a rollout function may not change: the trainer recomputes logprobs under the job's."""


@dataclass(frozen=True)
class Generation:
    """One policy turn: the tokens sampled, their processed logprobs and the weights version of each; with an MoE
    model whose engine returns them, the routed experts of the whole sequence, the turn's input and its tokens
    ([tokens, MoE layers, top_k], lockstep_workers.trainer.routing; else None)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routed_experts: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Episode:
    """What a rollout function returns: the tokens after the prompt, a logprob for each (the rollout engine's for
    policy tokens; any number for the others) and ``policy_mask``, True where the policy produced the token."""

    token_ids: list[int]
    logprobs: list[float]
    policy_mask: list[bool]


class Client(Protocol):
    """What a rollout function samples the policy with."""

    async def generate(self, token_ids: Sequence[int], sampling: Mapping[str, Any] | None = None) -> Generation:
        """One policy turn continuing ``token_ids``."""


RolloutFunction = Callable[[Mapping[str, Any], list[int], Client], Awaitable[Episode]]
"""``function(row, prompt_token_ids, client) -> Episode``."""

Generate = Callable[[Sequence[int], Mapping[str, Any]], Awaitable[Generation]]
"""One request to the actors, with the full sampling fields."""


async def single_turn(row: Mapping[str, Any], prompt_token_ids: list[int], client: Client) -> Episode:
    """The default rollout function: one completion of the prompt, every token the policy's."""
    turn = await client.generate(prompt_token_ids)
    return Episode(turn.token_ids, turn.logprobs, [True] * len(turn.token_ids))


@dataclass
class EpisodeClient:
    """The ``Client`` of one episode: requests go through ``send`` with the job's ``sampling`` under the caller's
    additions; every turn is recorded (``turns``), for the weights versions of the episode's tokens."""

    send: Generate
    sampling: Mapping[str, Any]
    turns: list[Generation] = field(default_factory=list)

    async def generate(self, token_ids: Sequence[int], sampling: Mapping[str, Any] | None = None) -> Generation:
        for name in LOCKED_SAMPLING:
            if sampling and name in sampling and sampling[name] != self.sampling.get(name):
                raise ValueError(
                    f"sampling.{name}: a rollout function may not change the job's {name} "
                    f"({self.sampling.get(name)}); set spec.trainer.rollout.{name.replace('_p', 'P')} instead"
                )
        turn = await self.send(list(token_ids), {**self.sampling, **(sampling or {})})
        self.turns.append(turn)
        return turn


def episode_rollout(episode: Episode, prompt: list[int], group: int, turns: Sequence[Generation]) -> Rollout:
    """The rollout of ``episode`` (raises ValueError naming what does not fit). Each policy token gets the version
    of its turn when the policy tokens are the turns' tokens in order, and the rollout the last turn's routed
    experts (which cover the conversation up to that turn's tokens, its input being the whole conversation so far);
    otherwise every token gets the oldest version of any turn, so that the staleness bound errs on the safe side,
    and the rollout no routed experts (the trainer routes it itself)."""
    lengths = {len(episode.token_ids), len(episode.logprobs), len(episode.policy_mask)}
    if len(lengths) != 1:
        raise ValueError(
            f"the rollout function returned {len(episode.token_ids)} token_ids, {len(episode.logprobs)} logprobs and "
            f"{len(episode.policy_mask)} policy_mask entries: expected one of each per token"
        )
    turn_tokens = [token for turn in turns for token in turn.token_ids]
    turn_versions = [version for turn in turns for version in turn.versions]
    policy_tokens = [token for token, own in zip(episode.token_ids, episode.policy_mask, strict=True) if own]
    oldest = min(turn_versions, default=0)
    routed_experts = None
    if policy_tokens == turn_tokens and len(turn_versions) == len(turn_tokens):
        own_versions = iter(turn_versions)
        versions = [next(own_versions) if own else oldest for own in episode.policy_mask]
        routed_experts = turns[-1].routed_experts if turns else None
    else:
        versions = [oldest] * len(episode.token_ids) if turn_versions else []
    return Rollout(
        list(prompt),
        list(episode.token_ids),
        [float(logprob) for logprob in episode.logprobs],
        group,
        versions,
        [bool(own) for own in episode.policy_mask],
        routed_experts,
    )
