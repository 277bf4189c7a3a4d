"""One batch of recommendations as arrays, encoded to the wire in one pass.

The worker publishes one recommendation per user per step, a few thousand a second per
GPU; building a validated :class:`Recommendation` for each (every item id, score and task
score checked in ``__post_init__``) cost a fifth of the event loop (issue 13). What the
model produced needs no re-validation: the arrays have known shapes and dtypes, and the
item ids come from the vocabulary. So the batch is kept as arrays and encoded straight to
msgpack or JSON; a consumer validates at its own boundary with
``Recommendation.from_bytes``, which accepts exactly these records (tested).

``records()`` builds the validated objects for callers that want them (the demo, tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import numpy.typing as npt
import orjson

from streamrec.errors import SchemaError
from streamrec.schemas.records import CacheOutcome, Recommendation
from streamrec.schemas.validation import ErrorKind
from streamrec.schemas.wire import WireFormat


@dataclass(frozen=True)
class RecommendationBatch:
    """``B`` users' recommendations; row ``b`` of every array belongs to ``user_ids[b]``."""

    user_ids: Sequence[str]  # [B]
    item_ids: npt.NDArray[np.object_]  # [B, K] external item ids (str), best first
    scores: npt.NDArray[np.float32]  # [B, K]
    task_scores: npt.NDArray[np.float32] | None  # [B, K, tasks], aligned with item_ids
    task_names: tuple[str, ...]
    versions: npt.NDArray[np.int64]  # [B]
    last_event_ts_ms: npt.NDArray[np.int64]  # [B]
    cache_outcomes: Sequence[CacheOutcome]  # [B]
    generated_at_ms: int
    model_name: str
    model_version: str
    timings_ms: Mapping[str, float] | None = None  # the step's phases, shared by the batch
    generated_ids: npt.NDArray[np.object_] | None = None  # [B, k] generated, in order
    generated_scores: npt.NDArray[np.float32] | None = None  # [B, k]

    def __post_init__(self) -> None:
        b = len(self.user_ids)
        shapes = {
            "item_ids": self.item_ids.shape[:1],
            "scores": self.scores.shape[:1],
            "versions": self.versions.shape,
            "last_event_ts_ms": self.last_event_ts_ms.shape,
        }
        if self.generated_ids is not None or self.generated_scores is not None:
            gen_ids, gen_scores = self.generated_ids, self.generated_scores
            if gen_ids is None or gen_scores is None or gen_ids.shape != gen_scores.shape:
                raise SchemaError(
                    ErrorKind.WRONG_TYPE,
                    "recommendation batch: generated_ids and generated_scores go together "
                    "with one shape",
                )
            shapes["generated_ids"] = gen_ids.shape[:1]
        bad = {name: shape for name, shape in shapes.items() if shape != (b,)}
        if bad or len(self.cache_outcomes) != b or self.item_ids.shape != self.scores.shape:
            raise SchemaError(
                ErrorKind.WRONG_TYPE,
                f"recommendation batch of {b} users has rows {bad or shapes} and "
                f"{len(self.cache_outcomes)} cache outcomes",
            )

    def __len__(self) -> int:
        return len(self.user_ids)

    def wire_maps(self) -> list[dict[str, object]]:
        """Each row as the map ``Recommendation.to_wire`` gives (same keys, same order;
        pairs and task rows are tuples/lists, which both codecs write as arrays)."""
        ids = self.item_ids.tolist()  # one C call per array instead of one per element
        scores = self.scores.tolist()
        versions = self.versions.tolist()
        last = self.last_event_ts_ms.tolist()
        tasks = None
        if self.task_scores is not None:
            tasks = self.task_scores.transpose(0, 2, 1).tolist()  # [B][tasks][K]
        names = self.task_names
        timings = dict(self.timings_ms) if self.timings_ms is not None else None
        gen_ids = gen_scores = None
        if self.generated_ids is not None and self.generated_scores is not None:
            gen_ids, gen_scores = self.generated_ids.tolist(), self.generated_scores.tolist()
        name, version, generated = self.model_name, self.model_version, self.generated_at_ms
        out: list[dict[str, object]] = []
        for b, user in enumerate(self.user_ids):
            fields: dict[str, object] = {
                "user_id": user,
                "items": list(zip(ids[b], scores[b], strict=True)),
                "model_name": name,
                "model_version": version,
                "version": versions[b],
                "last_event_ts_ms": last[b],
                "generated_at_ms": generated,
                "cache_outcome": self.cache_outcomes[b].value,
            }
            if tasks is not None:
                fields["task_scores"] = dict(zip(names, tasks[b], strict=True))
            if timings is not None:
                fields["timings_ms"] = timings
            if gen_ids is not None and gen_scores is not None:
                fields["generated"] = list(zip(gen_ids[b], gen_scores[b], strict=True))
            out.append(fields)
        return out

    def encode(self, fmt: WireFormat = WireFormat.MSGPACK) -> list[bytes]:
        """Wire bytes per user, in row order."""
        if fmt is WireFormat.MSGPACK:
            return self._msgpack_rows()
        return [orjson.dumps(fields) for fields in self.wire_maps()]

    def _msgpack_rows(self) -> list[bytes]:
        """The bytes ``msgpack`` gives for each ``wire_maps`` row, without the maps.

        Building one dict per user was most of the encode (4.8 ms for 256 users, 20 items
        and 3 tasks on the CPU machine, best of 5); the keys, the batch-wide values and the
        cache outcomes are packed once here and each row joins its parts: 2.8 ms, the same
        bytes (tested against ``Recommendation.to_bytes``)."""
        pack = msgpack.Packer(use_bin_type=True).pack
        header = msgpack.Packer().pack_map_header
        ids, scores = self.item_ids.tolist(), self.scores.tolist()
        versions, last = self.versions.tolist(), self.last_event_ts_ms.tolist()
        tasks = None
        if self.task_scores is not None:
            tasks = self.task_scores.transpose(0, 2, 1).tolist()  # [B][tasks][K]
        gen_ids = gen_scores = None
        if self.generated_ids is not None and self.generated_scores is not None:
            gen_ids, gen_scores = self.generated_ids.tolist(), self.generated_scores.tolist()
        optional = (tasks is not None) + (self.timings_ms is not None) + (gen_ids is not None)
        head = header(8 + optional) + pack("user_id")
        items_key = pack("items")
        model = (
            pack("model_name") + pack(self.model_name) + pack("model_version")
            + pack(self.model_version) + pack("version")
        )  # fmt: skip
        last_key = pack("last_event_ts_ms")
        outcome_key = pack("generated_at_ms") + pack(self.generated_at_ms) + pack("cache_outcome")
        outcomes = {o: pack(o.value) for o in set(self.cache_outcomes)}
        task_keys = [pack(name) for name in self.task_names]
        tasks_key = pack("task_scores") + header(len(task_keys))
        timings = b""
        if self.timings_ms is not None:
            timings = pack("timings_ms") + pack(dict(self.timings_ms))
        generated_key = pack("generated")
        out: list[bytes] = []
        for b, user in enumerate(self.user_ids):
            parts = [
                head, pack(user), items_key, pack(list(zip(ids[b], scores[b], strict=True))),
                model, pack(versions[b]), last_key, pack(last[b]), outcome_key,
                outcomes[self.cache_outcomes[b]],
            ]  # fmt: skip
            if tasks is not None:
                parts.append(tasks_key)
                for key, row in zip(task_keys, tasks[b], strict=True):
                    parts += (key, pack(row))
            parts.append(timings)
            if gen_ids is not None and gen_scores is not None:
                pairs = list(zip(gen_ids[b], gen_scores[b], strict=True))
                parts += (generated_key, pack(pairs))
            out.append(b"".join(parts))
        return out

    def records(self) -> list[Recommendation]:
        """Validated objects (off the hot path: the demo, tests)."""
        return [Recommendation.from_wire(fields) for fields in self.wire_maps()]
