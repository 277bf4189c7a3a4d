"""``streamrec export`` argument handling (the compile itself: test_aoti_export.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from streamrec.tools.export_command import add_export_arguments, run_export
from streamrec.worker.config import ModelConfig, WorkerConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    return parser.parse_args(list(argv))


def test_missing_model_dir_fails_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = WorkerConfig(model=ModelConfig(model_dir=tmp_path / "nope", aoti_cache_dir=tmp_path))
    assert run_export(parse(), config, "cpu") == 1
    err = capsys.readouterr().err
    assert "export failed" in err and str(tmp_path / "nope") in err


def test_unknown_entry_point_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = WorkerConfig(model=ModelConfig(aoti_cache_dir=tmp_path))
    assert run_export(parse("--entry-points", "decode"), config, "cpu") == 1
    assert "decode" in capsys.readouterr().err
