"""A batch of recommendations encoded from arrays is exactly what a validated
``Recommendation`` would put on the wire, in both formats."""

from __future__ import annotations

import numpy as np
import pytest

from streamrec.errors import SchemaError
from streamrec.schemas.recommendation_batch import RecommendationBatch
from streamrec.schemas.records import CacheOutcome, Recommendation
from streamrec.schemas.wire import WireFormat


def _batch(
    users: int = 3, k: int = 4, tasks: bool = True, timings: bool = True, generated: bool = False
) -> RecommendationBatch:
    rng = np.random.default_rng(0)
    ids = np.array([[f"i{u}-{j}" for j in range(k)] for u in range(users)], dtype=object)
    gen = np.array([[f"g{u}-{j}" for j in range(2)] for u in range(users)], dtype=object)
    return RecommendationBatch(
        user_ids=[f"u{u}" for u in range(users)],
        item_ids=ids,
        scores=rng.random((users, k), dtype=np.float32),
        task_scores=rng.random((users, k, 2), dtype=np.float32) if tasks else None,
        task_names=("complete", "skip"),
        versions=np.arange(1, users + 1, dtype=np.int64) * 10,
        last_event_ts_ms=np.full(users, 1_700_000_000_000, dtype=np.int64),
        cache_outcomes=[CacheOutcome.GPU_HIT, CacheOutcome.MISS, CacheOutcome.HOST_HIT][:users],
        generated_at_ms=1_700_000_000_123,
        model_name="m",
        model_version="v1",
        timings_ms={"extend": 1.25} if timings else None,
        generated_ids=gen if generated else None,
        generated_scores=rng.random((users, 2), dtype=np.float32) if generated else None,
    )


@pytest.mark.parametrize("fmt", [WireFormat.MSGPACK, WireFormat.JSON])
@pytest.mark.parametrize("tasks", [True, False])
def test_encoded_rows_decode_to_the_same_validated_records(fmt: WireFormat, tasks: bool) -> None:
    batch = _batch(tasks=tasks)
    records = batch.records()
    for value, record in zip(batch.encode(fmt), records, strict=True):
        decoded = Recommendation.from_bytes(value, fmt)
        assert decoded == record
        assert value == record.to_bytes(fmt)  # byte for byte the validated encoding
    first = records[0]
    assert first.user_id == "u0" and first.version == 10
    assert [item for item, _ in first.items] == ["i0-0", "i0-1", "i0-2", "i0-3"]
    assert first.cache_outcome is CacheOutcome.GPU_HIT
    if tasks:
        assert first.task_scores is not None and set(first.task_scores) == {"complete", "skip"}
        scores = first.task_scores["skip"]
        assert scores == pytest.approx(batch.task_scores[0, :, 1].tolist())  # type: ignore[index]


@pytest.mark.parametrize("fmt", [WireFormat.MSGPACK, WireFormat.JSON])
@pytest.mark.parametrize(
    ("tasks", "timings", "generated"),
    [(False, False, False), (True, False, True), (True, True, True)],
)
def test_every_optional_field_encodes_as_the_validated_record(
    fmt: WireFormat, tasks: bool, timings: bool, generated: bool
) -> None:
    # msgpack rows are joined from parts packed once per batch, not packed from maps
    batch = _batch(tasks=tasks, timings=timings, generated=generated)
    records = batch.records()
    assert (records[1].generated is not None) == generated
    assert (records[1].timings_ms is not None) == timings
    assert batch.encode(fmt) == [record.to_bytes(fmt) for record in records]


def test_rows_that_do_not_line_up_are_rejected() -> None:
    good = _batch()
    with pytest.raises(SchemaError, match="3 users"):
        RecommendationBatch(
            **{**good.__dict__, "versions": np.zeros(2, dtype=np.int64)},
        )
