"""``streamrec eval``: one model, or ``--seeds N`` against the baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrec.tools.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--synthetic"], "streamrec eval: error: eval needs --model DIR"),
        (["eval", "--seeds", "0"], "streamrec eval: error: --seeds 0: must be an int >= 1"),
        (["eval", "--seeds", "1", "--model", "m"], "streamrec eval: error: --model and --seeds"),
        (["eval", "--seeds", "1", "--patience", "-1"], "streamrec eval: error: TrainConfig.patie"),
        (["eval", "--seeds", "1", "--lr-grid", "x"], "streamrec eval: error: --lr-grid 'x'"),
    ],
)
def test_eval_mistakes_are_one_line_and_status_1(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_an_unknown_baseline_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["eval", "--seeds", "2", "--baseline", "bert4rec"])
    assert done.value.code == 2
    assert "invalid choice: 'bert4rec'" in capsys.readouterr().err


@pytest.mark.slow
def test_seeds_against_sasrec_prints_mean_std_and_intervals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    argv = ["eval", "--synthetic", "--seeds", "2", "--baseline", "sasrec", "--epochs", "1",
            "--out", str(tmp_path / "models"), "--json", str(out), "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "sasrec" in text and "±" in text and "hstu − sasrec: HR" in text
    assert "most-popular" not in text  # only the baseline asked for
    data = json.loads(out.read_text())
    assert len(data["runs"]["hstu"]) == 2 and "hstu - sasrec" in data["intervals"]
    assert data["command"].startswith("streamrec ")
    model = tmp_path / "models" / "sasrec-seed0"
    assert main(["eval", "--synthetic", "--model", str(model), "--split", "validation",
                 "--device", "cpu"]) == 0  # fmt: skip
    assert "most-pop" in capsys.readouterr().out
