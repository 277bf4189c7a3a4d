from dataclasses import FrozenInstanceError, fields

import pytest

from streamrec.schemas.events import (
    INTERACTION_ACTIONS,
    NUM_ACTIONS,
    Action,
    EventKind,
    InteractionEvent,
    PlaybackEvent,
    playback_action,
    rating_action,
    trusted_interaction,
    trusted_playback,
)


def test_action_values_are_the_contract() -> None:
    expected = {
        "CANDIDATE": 0,
        "COMPLETE": 1,
        "PARTIAL": 2,
        "SKIP": 3,
        "LIKE": 4,
        "UNLIKE": 5,
        "SAVE": 6,
        "SHARE": 7,
        "ADD_TO_PLAYLIST": 8,
        "CLICK": 9,
        "HIDE": 10,
        "VIEW": 11,
    }
    assert {a.name: a.value for a in Action} == expected
    assert NUM_ACTIONS == 12


@pytest.mark.parametrize(
    ("ms_played", "duration_ms", "action"),
    [
        (0, 0, Action.SKIP),  # unknown duration
        (5_000, 0, Action.SKIP),
        (0, 1_000, Action.SKIP),
        (249, 1_000, Action.SKIP),
        (250, 1_000, Action.PARTIAL),  # exactly 0.25
        (799, 1_000, Action.PARTIAL),
        (800, 1_000, Action.COMPLETE),  # exactly 0.8
        (3_000, 1_000, Action.COMPLETE),  # replayed past the end
        (24_000, 30_000, Action.COMPLETE),  # 0.8 of a length that is not a round number
        (23_999, 30_000, Action.PARTIAL),
        (7_500, 30_000, Action.PARTIAL),
        (7_499, 30_000, Action.SKIP),
    ],
)
def test_playback_action_thresholds(ms_played: int, duration_ms: int, action: Action) -> None:
    assert playback_action(ms_played, duration_ms) is action
    event = PlaybackEvent("u", "i", 1, ms_played, duration_ms)
    assert event.token_action is action
    assert event.token == ("i", action, 1)
    assert event.kind is EventKind.PLAYBACK


def test_interaction_vocabulary() -> None:
    assert dict(INTERACTION_ACTIONS) == {
        "like": Action.LIKE,
        "unlike": Action.UNLIKE,
        "save": Action.SAVE,
        "share": Action.SHARE,
        "add_to_playlist": Action.ADD_TO_PLAYLIST,
        "skip": Action.SKIP,
        "click": Action.CLICK,
        "hide": Action.HIDE,
    }
    for name, action in INTERACTION_ACTIONS.items():
        event = InteractionEvent("u", "i", 7, name)
        assert event.token_action is action
        assert event.token == ("i", action, 7)
        assert event.kind is EventKind.INTERACTION
    with pytest.raises(TypeError):
        INTERACTION_ACTIONS["new"] = Action.LIKE  # type: ignore[index]


def test_rating_action() -> None:
    assert rating_action(4.0) is Action.LIKE
    assert rating_action(5) is Action.LIKE
    assert rating_action(3.5) is Action.VIEW


def test_events_are_frozen_and_hashable_even_with_context() -> None:
    event = PlaybackEvent("u", "i", 1, 2, 3, {"device": "tv"})
    with pytest.raises(FrozenInstanceError):
        event.ts_ms = 5  # type: ignore[misc]
    assert hash(event) == hash(PlaybackEvent("u", "i", 1, 2, 3, {"device": "phone"}))
    assert not hasattr(event, "__dict__")


def test_trusted_constructors_build_identical_events() -> None:
    built = trusted_playback("u", "i", 1, 2, 3, {"a": 1})
    assert built == PlaybackEvent("u", "i", 1, 2, 3, {"a": 1})
    assert [getattr(built, f.name) for f in fields(built)] == ["u", "i", 1, 2, 3, {"a": 1}]
    interaction = trusted_interaction("u", "i", 1, "like")
    assert interaction == InteractionEvent("u", "i", 1, "like")
    with pytest.raises(FrozenInstanceError):
        interaction.action = "hide"  # type: ignore[misc]
