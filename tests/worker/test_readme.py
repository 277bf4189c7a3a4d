"""The README's configuration reference and wire examples must match the code."""

from __future__ import annotations

import re
from pathlib import Path

from streamrec.schemas.codec import decode_event
from streamrec.schemas.events import EventKind, InteractionEvent, PlaybackEvent
from streamrec.schemas.records import DeadLetter, Recommendation
from streamrec.schemas.wire import WireFormat
from streamrec.worker.config import config_fields

README = Path(__file__).resolve().parents[2] / "README.md"


def json_blocks(text: str) -> list[bytes]:
    return [block.encode() for block in re.findall(r"```json\n(.*?)```", text, re.S)]


def test_every_config_field_is_documented_with_its_env_var() -> None:
    text = README.read_text()
    missing = [f.env_var for f in config_fields() if f"`{f.env_var}`" not in text]
    assert missing == []


def test_wire_examples_decode_with_the_schemas() -> None:
    playback, interaction, recommendation, dead_letter = json_blocks(README.read_text())
    assert isinstance(decode_event(playback, EventKind.PLAYBACK), PlaybackEvent)
    assert decode_event(interaction, EventKind.INTERACTION) == InteractionEvent(
        "u1", "i9", 1764529201000, "like"
    )
    rec = Recommendation.from_bytes(recommendation, WireFormat.JSON)
    assert rec.item_ids == ["i42", "i7", "i9"]
    letter = DeadLetter.from_bytes(dead_letter, WireFormat.JSON)
    assert letter.value == b'{"user_id":"u1","item_id":"i9","ts_ms":-5,"action":"like"}'
    assert (letter.topic, letter.partition, letter.offset) == ("interaction-events", 3, 1207)
