"""The job's vLLM settings (``VllmSettings``: the ParityPolicy's locked ones merged with the job's), mapped onto
the engine arguments of the vLLM that is installed.

Each set setting is one of:

- **applied**: passed to vLLM under its engine-argument name;
- **satisfied by construction**: it turns off a behaviour this vLLM no longer has, so it holds without being
  passed (vLLM would warn about it, and a later vLLM rejects it);
- **refused**: this vLLM cannot honour it (no such engine argument, a value it does not accept, or it asks for
  a behaviour this vLLM no longer has); the actor does not start.

What a vLLM accepts is read from vLLM itself (``installed_vllm``): the fields of its
``EngineArgs`` and the CLI parser it builds from them (choices, deprecation notes). What a removed behaviour
means for a setting's values is the one thing vLLM does not say: that is the small table ``REMOVED``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.api import VllmSettings

logger = logging.getLogger("lockstep.vllm_args")


@dataclass(frozen=True)
class Removed:
    """A behaviour vLLM removed, and the setting value that turned it off (which now holds by construction)."""

    behaviour: str
    off: Any


REMOVED: dict[str, Removed] = {
    # vLLM 0.32 deprecates --disable-cascade-attn ("has no effect since cascade attention has been removed");
    # 0.33 drops the argument. Neither says that True is the value that now holds: this table does.
    "disable_cascade_attn": Removed("cascade attention", off=True),
}
"""Engine arguments whose behaviour vLLM removed, consulted once the installed vLLM deprecates the argument or no
longer has it."""


class UnsupportedSetting(ValueError):
    """The installed vLLM cannot honour one or more of the job's vLLM settings."""


@dataclass(frozen=True)
class EngineArgsDescription:
    """What a vLLM accepts as engine arguments."""

    version: str
    arguments: frozenset[str]
    """The fields of its EngineArgs."""
    choices: Mapping[str, frozenset[str]]
    """argument → the values its CLI flag accepts, where the flag restricts them."""
    deprecated: Mapping[str, str]
    """argument → vLLM's deprecation note, for the flags it marks deprecated."""


@functools.cache
def installed_vllm() -> EngineArgsDescription:
    """The installed vLLM's engine arguments, from its AsyncEngineArgs and the parser ``vllm serve`` builds from
    them (about 1.5 s; once per process)."""
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    actions = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())._actions  # type: ignore[no-untyped-call]
    return EngineArgsDescription(
        version=vllm.__version__,
        arguments=frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs)),
        choices={a.dest: frozenset(map(str, a.choices)) for a in actions if a.choices is not None},
        # vLLM marks a deprecated flag in its help text (0.32: --disable-cascade-attn), or with argparse's own
        # `deprecated` (Python 3.13 and later).
        deprecated={
            a.dest: a.help or "deprecated"
            for a in actions
            if getattr(a, "deprecated", False) or "deprecated" in (a.help or "").lower()
        },
    )


@dataclass(frozen=True)
class AppliedSettings:
    """The outcome of mapping settings onto a vLLM: what is passed to it, and what holds without being passed."""

    engine_args: dict[str, Any]
    """Engine-argument name → value (JSON values, as the settings hold them)."""
    satisfied_by_construction: dict[str, str]
    """Setting (API name, as on the ParityPolicy) → why it holds without being passed."""

    def report(self) -> dict[str, Any]:
        """As the actor's /ready and the preflight result report it."""
        return {"engineArgs": self.engine_args, "satisfiedByConstruction": sorted(self.satisfied_by_construction)}


def map_settings(settings: VllmSettings, vllm: EngineArgsDescription) -> AppliedSettings:
    """Map every set setting onto ``vllm``; raise UnsupportedSetting naming each one it cannot honour."""
    engine_args: dict[str, Any] = {}
    satisfied: dict[str, str] = {}
    refused: list[str] = []
    for name, value in settings.model_dump(mode="json", exclude_none=True).items():
        alias = VllmSettings.model_fields[name].alias or name
        setting = f"{alias}={_show(value)}"
        removed = REMOVED.get(name)
        if removed is not None and (name not in vllm.arguments or name in vllm.deprecated):
            evidence = (
                f"vLLM says: {vllm.deprecated[name]!r}"
                if name in vllm.deprecated
                else f"it has no engine argument {name}"
            )
            gone = f"vLLM {vllm.version} no longer has {removed.behaviour} ({evidence})"
            if value == removed.off:
                satisfied[alias] = gone
            else:
                refused.append(
                    f"{setting} asks for {removed.behaviour}, but {gone}; set it to {_show(removed.off)} or remove it"
                )
        elif name not in vllm.arguments:
            refused.append(f"{setting}: vLLM {vllm.version} has no engine argument {name}")
        elif name in vllm.choices and str(value) not in vllm.choices[name]:
            refused.append(
                f"{setting}: vLLM {vllm.version} accepts only {', '.join(sorted(vllm.choices[name]))} for {name}"
            )
        else:
            engine_args[name] = value
    if refused:
        raise UnsupportedSetting(
            "the vLLM in this image cannot honour these vLLM settings of the job (its ParityPolicy's locked ones "
            f"and spec.actors.vllm): {'; '.join(refused)}. Change the setting, or run an image whose vLLM supports it"
        )
    for setting, reason in satisfied.items():
        logger.info("not passing %s to vLLM, it holds by construction: %s", setting, reason)
    return AppliedSettings(engine_args, satisfied)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
