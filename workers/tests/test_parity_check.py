"""`lockstep parity-check` on a tiny peaky bf16 Llama shows each of the four fixes, the stale-KV trap and
what is left for truncated importance sampling; the locked configuration comes out closest."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_parity_check_reproduces_the_fixes_and_ranks_the_locked_policy_closest(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(Path(sys.executable).with_name("lockstep")), "parity-check", "--out", str(tmp_path), "--prompts", "6"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    causes = [line for line in run.stderr.splitlines() if "Error" in line or "error" in line]
    assert run.returncode == 0, "\n".join(causes[-15:]) or run.stderr[-3000:]
    assert "train-inference mismatch" in run.stdout and (tmp_path / "parity.png").stat().st_size > 0
    results = {c["name"]: c for c in json.loads((tmp_path / "parity.json").read_text())["configurations"]}
    batch = {name: c["batch"] for name, c in results.items()}
    progressive = [name for name in results if name == "vLLM V1 defaults" or name.startswith("+ ")]
    drops = {
        later: batch[earlier]["meanAbsDiff"] - batch[later]["meanAbsDiff"]
        for earlier, later in itertools.pairwise(progressive)
    }
    assert max(drops, key=lambda name: drops[name]) == "+ processed logprobs", "raw vs processed is the largest gap"
    assert batch["vLLM V1 defaults"]["clipFraction"] > 5 * batch["+ processed logprobs"]["clipFraction"]

    locked = next(name for name in results if name.startswith("locked (") and not name.endswith("fp32 model"))
    stale = results["locked + prefix caching"]
    assert stale["refusedByPolicy"] and "clearCache" in stale["refusedByPolicy"]
    assert stale["sharedPrefix"]["meanAbsDiff"] > 10 * results[locked]["sharedPrefix"]["meanAbsDiff"], (
        "with prefix caching on and clear_cache=False, requests after an update reuse KV from the old weights"
    )

    same_dtype = [name for name in results if not name.endswith("fp32 model")]
    closest = min(batch[name]["meanAbsDiff"] for name in same_dtype)
    # "+ fp32 lm_head" has the same settings as the default policy: a tie, up to run-to-run noise.
    assert batch[locked]["meanAbsDiff"] <= closest * 1.001, "the locked configuration is the closest to the trainer"
    fp32 = batch[f"{locked}, fp32 model"]
    assert fp32["meanAbsDiff"] < min(1e-4, batch[locked]["meanAbsDiff"] / 100), "what is left in bf16 is numerics"
    assert all("outsideTopP" in c["topP"] for c in results.values()), "tokens outside top-p are counted apart"
