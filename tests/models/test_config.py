from __future__ import annotations

import pytest

from streamrec.errors import ConfigError
from streamrec.models.config import HSTUConfig


def test_round_trip_and_derived_fields() -> None:
    cfg = HSTUConfig(num_items=100, num_oov_buckets=4, task_names=("like",), dtype="bfloat16")
    assert HSTUConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.first_item_row == 5 and cfg.num_tasks == 1 and cfg.num_actions == 12


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", 0, "num_heads=0"),
        ("num_items", 3, "num_items=3"),
        ("dtype", "int8", "dtype='int8'"),
        ("task_names", ("a", "a"), "task_names"),
        ("dropout", 1.0, "dropout=1.0"),
        ("time_bucket_width", 0.0, "time_bucket_width=0.0"),
    ],
)
def test_invalid_values_are_named(field: str, value: object, message: str) -> None:
    kwargs = {"num_items": 100, field: value}
    with pytest.raises(ConfigError, match=message):
        HSTUConfig(**kwargs)  # type: ignore[arg-type]


def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    with pytest.raises(ConfigError, match="colour"):
        HSTUConfig.from_dict({"num_items": 100, "colour": 1})
    with pytest.raises(ConfigError, match="num_items"):
        HSTUConfig.from_dict({"d_model": 8})
