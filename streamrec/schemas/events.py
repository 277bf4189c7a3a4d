"""Input events and the model token each one becomes.

Every event turns into exactly one token ``(item, action, ts_ms)``. The mapping from
what happened on the wire to the token's :class:`Action` lives only here, so training,
replay and the live worker cannot disagree about it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Final, TypeAlias


class Action(enum.IntEnum):
    """The action slot of a token; values are baked into trained embeddings, never renumber."""

    CANDIDATE = 0  # never on the wire: the action slot of a ranking candidate
    COMPLETE = 1
    PARTIAL = 2
    SKIP = 3
    LIKE = 4
    UNLIKE = 5
    SAVE = 6
    SHARE = 7
    ADD_TO_PLAYLIST = 8
    CLICK = 9
    HIDE = 10
    VIEW = 11


NUM_ACTIONS: Final = len(Action)

# Playback thresholds as exact fractions (numerator, denominator) so the decision is made in
# integer arithmetic: a float division would put ms_played = 0.8 * duration on either side
# depending on rounding.
COMPLETE_FRACTION: Final = (4, 5)  # fraction played >= 0.8  -> COMPLETE
PARTIAL_FRACTION: Final = (1, 4)  # fraction played >= 0.25 -> PARTIAL, below -> SKIP

# MovieLens-style explicit ratings (used for offline training data): >= 4 is a like.
LIKE_MIN_RATING: Final = 4.0


def playback_action(ms_played: int, duration_ms: int) -> Action:
    """The one definition of how a playback becomes an action.

    fraction = ms_played / duration_ms; fraction >= 0.8 is COMPLETE, >= 0.25 is PARTIAL,
    anything less is SKIP. A zero duration (unknown length) carries no evidence of
    engagement and counts as SKIP; playing past the end (replays, seeking) is COMPLETE.
    """
    if duration_ms <= 0:
        return Action.SKIP
    num, den = COMPLETE_FRACTION
    if ms_played * den >= duration_ms * num:
        return Action.COMPLETE
    num, den = PARTIAL_FRACTION
    if ms_played * den >= duration_ms * num:
        return Action.PARTIAL
    return Action.SKIP


def rating_action(rating: float) -> Action:
    """Map an explicit rating (MovieLens, 0.5-5 stars) to a token action: LIKE or VIEW."""
    return Action.LIKE if rating >= LIKE_MIN_RATING else Action.VIEW


# The interaction vocabulary accepted on the wire (exact, lower-case spelling).
INTERACTION_ACTIONS: Final = MappingProxyType(
    {
        "like": Action.LIKE,
        "unlike": Action.UNLIKE,
        "save": Action.SAVE,
        "share": Action.SHARE,
        "add_to_playlist": Action.ADD_TO_PLAYLIST,
        "skip": Action.SKIP,
        "click": Action.CLICK,
        "hide": Action.HIDE,
    }
)


class EventKind(enum.Enum):
    """Which schema a record follows; decided by the topic it came from, not by the record."""

    PLAYBACK = "playback"
    INTERACTION = "interaction"


Token: TypeAlias = tuple[str, Action, int]  # (item_id, action, ts_ms)


@dataclass(frozen=True, slots=True)
class PlaybackEvent:
    """A user played (part of) an item. Validated by the codec, not here: the hot path
    builds millions of these and must not pay for a second validation."""

    user_id: str
    item_id: str
    ts_ms: int
    ms_played: int
    duration_ms: int
    # Free-form client context (device, surface, ...); carried, never fed to the model.
    context: dict[str, object] | None = field(default=None, hash=False)

    @property
    def kind(self) -> EventKind:
        return EventKind.PLAYBACK

    @property
    def token_action(self) -> Action:
        return playback_action(self.ms_played, self.duration_ms)

    @property
    def token(self) -> Token:
        return (self.item_id, self.token_action, self.ts_ms)


@dataclass(frozen=True, slots=True)
class InteractionEvent:
    """An explicit user action on an item; ``action`` is a key of INTERACTION_ACTIONS."""

    user_id: str
    item_id: str
    ts_ms: int
    action: str

    @property
    def kind(self) -> EventKind:
        return EventKind.INTERACTION

    @property
    def token_action(self) -> Action:
        return INTERACTION_ACTIONS[self.action]

    @property
    def token(self) -> Token:
        return (self.item_id, self.token_action, self.ts_ms)


Event: TypeAlias = PlaybackEvent | InteractionEvent


# --- trusted constructors for the decoder's hot path ---------------------------------
# A frozen dataclass's __init__ assigns every field through object.__setattr__, which costs
# about 0.5 µs for six fields; assigning the slots through their member descriptors does the
# same job in about half the time, which is what lets one core decode >300k events/s. The
# instances are indistinguishable from __init__-built ones. Callers must pass valid values.

_PLAYBACK_FIELDS: Final = ("user_id", "item_id", "ts_ms", "ms_played", "duration_ms", "context")
_INTERACTION_FIELDS: Final = ("user_id", "item_id", "ts_ms", "action")
if (
    tuple(f.name for f in fields(PlaybackEvent)) != _PLAYBACK_FIELDS
    or tuple(f.name for f in fields(InteractionEvent)) != _INTERACTION_FIELDS
):  # pragma: no cover - guards the unrolled setters below
    raise ImportError("event fields changed: update the trusted constructors in events.py")

_new = object.__new__
_set_pb_user, _set_pb_item, _set_pb_ts, _set_pb_played, _set_pb_duration, _set_pb_context = (
    PlaybackEvent.__dict__[name].__set__ for name in _PLAYBACK_FIELDS
)
_set_ia_user, _set_ia_item, _set_ia_ts, _set_ia_action = (
    InteractionEvent.__dict__[name].__set__ for name in _INTERACTION_FIELDS
)


def trusted_playback(
    user_id: str,
    item_id: str,
    ts_ms: int,
    ms_played: int,
    duration_ms: int,
    context: dict[str, object] | None,
) -> PlaybackEvent:
    """PlaybackEvent(...) without the frozen-__setattr__ cost; values must be validated."""
    event: PlaybackEvent = _new(PlaybackEvent)
    _set_pb_user(event, user_id)
    _set_pb_item(event, item_id)
    _set_pb_ts(event, ts_ms)
    _set_pb_played(event, ms_played)
    _set_pb_duration(event, duration_ms)
    _set_pb_context(event, context)
    return event


def trusted_interaction(user_id: str, item_id: str, ts_ms: int, action: str) -> InteractionEvent:
    """InteractionEvent(...) without the frozen-__setattr__ cost; values must be validated."""
    event: InteractionEvent = _new(InteractionEvent)
    _set_ia_user(event, user_id)
    _set_ia_item(event, item_id)
    _set_ia_ts(event, ts_ms)
    _set_ia_action(event, action)
    return event
