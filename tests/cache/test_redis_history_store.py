import pytest

from streamrec.cache.history_backends import open_history_store
from streamrec.cache.history_store import HistoryEvent, Token
from streamrec.cache.redis_history_store import RedisHistoryStore
from streamrec.errors import ConfigError, StoreError


@pytest.mark.redis
async def test_a_fresh_store_reads_the_same_histories_back(redis_url: str) -> None:
    events = [
        HistoryEvent(f"u{i % 7}", "playback-events", i % 2, i, Token(i, i % 12, 1000 * i))
        for i in range(300)
    ]
    first = open_history_store(redis_url, 16)
    assert isinstance(first, RedisHistoryStore)
    await first.append(events)
    users = [f"u{i}" for i in range(7)]
    before = await first.get(users)
    await first.drop(users)  # a rebalance keeps the shared data
    await first.close()

    second = open_history_store(redis_url, 16)  # e.g. after a restart, or on another worker
    after = await second.get(users)
    assert all(after[u].same_as(before[u]) for u in users)
    assert len(after["u0"]) == 16 and after["u0"].total_appended == 43
    # Redelivering everything to the new object changes nothing.
    result = await second.append(events)
    assert (result.total_applied, result.skipped) == (0, 300)
    await second.close()


@pytest.mark.redis
async def test_prefix_isolates_stores_on_one_server(redis_url: str) -> None:
    a = open_history_store(redis_url, 8)
    b = open_history_store(redis_url + "-other", 8)
    assert isinstance(a, RedisHistoryStore) and a.prefix + "-other" == getattr(b, "prefix", None)
    await a.append([HistoryEvent("u", "t", 0, 1, Token(1, 1, 1))])
    assert len((await b.get(["u"]))["u"]) == 0
    await a.close()
    await b.close()


async def test_unreachable_redis_is_a_store_error_naming_the_url() -> None:
    store = open_history_store("redis://127.0.0.1:1/0?prefix=x", 8)
    with pytest.raises(StoreError, match=r"redis://127\.0\.0\.1:1/0"):
        await store.append([HistoryEvent("u", "t", 0, 1, Token(1, 1, 1))])
    with pytest.raises(StoreError, match="unreachable"):
        await store.ping()
    await store.close()


def test_bad_urls_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="prefix must not be empty"):
        RedisHistoryStore("redis://127.0.0.1:6379/0?prefix=", 8)
    with pytest.raises(ConfigError, match="not a redis"):
        RedisHistoryStore("memory://", 8)


@pytest.mark.redis
async def test_a_script_unknown_to_the_server_is_loaded_and_the_batch_retried(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib
    import uuid

    import streamrec.cache.redis_history_store as module

    # A never-seen variant of the script (a unique comment) hits NOSCRIPT once.
    lua = module._APPEND_LUA + f"-- {uuid.uuid4().hex}\n".encode()
    monkeypatch.setattr(module, "_APPEND_LUA", lua)
    monkeypatch.setattr(module, "_APPEND_SHA", hashlib.sha1(lua).hexdigest())
    store = open_history_store(redis_url, 8)
    result = await store.append([HistoryEvent("u", "t", 0, 1, Token(1, 2, 3))])
    assert result.applied == {"u": 1}
    assert (await store.get(["u"]))["u"].items.tolist() == [1]
    await store.close()
