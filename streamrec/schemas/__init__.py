"""Wire types (events in, recommendations and dead letters out) and their codecs.

Depends on nothing else in streamrec: every other layer imports from here.
"""

from streamrec.schemas.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    DecodedBatch,
    DecodedEvent,
    RawRecord,
    RejectedRecord,
    decode_batch,
    decode_event,
    encode_event,
    event_to_wire,
)
from streamrec.schemas.events import (
    INTERACTION_ACTIONS,
    NUM_ACTIONS,
    Action,
    Event,
    EventKind,
    InteractionEvent,
    PlaybackEvent,
    Token,
    playback_action,
    rating_action,
)
from streamrec.schemas.records import CacheOutcome, DeadLetter, Recommendation
from streamrec.schemas.validation import ErrorKind
from streamrec.schemas.wire import CONTENT_TYPE_HEADER, WireFormat, detect_format

__all__ = [
    "CONTENT_TYPE_HEADER",
    "DEFAULT_MAX_RECORD_BYTES",
    "INTERACTION_ACTIONS",
    "NUM_ACTIONS",
    "Action",
    "CacheOutcome",
    "DeadLetter",
    "DecodedBatch",
    "DecodedEvent",
    "ErrorKind",
    "Event",
    "EventKind",
    "InteractionEvent",
    "PlaybackEvent",
    "RawRecord",
    "Recommendation",
    "RejectedRecord",
    "Token",
    "WireFormat",
    "decode_batch",
    "decode_event",
    "detect_format",
    "encode_event",
    "event_to_wire",
    "playback_action",
    "rating_action",
]
