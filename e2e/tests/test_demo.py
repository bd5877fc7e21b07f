"""The demo's metrics table reads whole in an 80-column terminal and a log file."""

from __future__ import annotations

import io

from rich.console import Console

from lockstep_e2e.demo import COLUMNS, metrics_table
from lockstep_e2e.rl import EVAL


def test_the_metrics_table_fits_80_columns_with_every_value_whole() -> None:
    widest = {
        "step": 120,
        "reward": 0.984,
        EVAL: 0.775,
        "clamp_log_ratio_new_old_indicator": 0.0123,
        "kl_new_old": -1.23e-05,
        "ess": 0.987,
        "onpolicy_mean_abs_logprob_diff": None,
        "staleness": 2,
        "seconds": 117.2,
        "actor_busy_fraction": 1.0,
    }
    assert set(widest) == {key for _, key, _, _ in COLUMNS}
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(metrics_table("smollm2", [widest, {"step": 121, "reward": 0.5}]))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    table = "\n".join(lines)
    assert "…" not in table
    for shown in ("120", "0.984", "0.78", "0.012", "-1.2e-05", "0.987", "none", "117.2", "100%", "121", "0.500"):
        assert shown in table, shown
