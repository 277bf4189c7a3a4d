"""Redis history store: shared by every worker, survives restarts and rebalances.

Per user two keys (hash-tagged on the user, so a Redis Cluster keeps them together):

- ``<prefix>:{<user>}:t`` — the last ``max_seq_len`` tokens as one binary string of
  packed little-endian int64 triples ``(item, action, ts_ms)``, 24 bytes each: appending
  is ``APPEND``, the window is one ``GETRANGE`` and a read is one ``GET``.
- ``<prefix>:{<user>}:w`` — a hash of ``"<topic>:<partition>" -> last applied offset``
  plus ``"#total"`` (tokens ever applied; ``#`` is not legal in a Kafka topic name).

An append is ONE round trip: a non-transactional pipeline with one ``EVALSHA`` per user.
The Lua script checks every event against the watermarks, appends the applied tokens,
trims and moves the watermarks, atomically per user, so retrying a failed batch is always
safe. The script is addressed by its SHA-1; only after a Redis restart (``NOSCRIPT``)
does a batch pay one extra round trip to load it again. Offsets go through Lua numbers
(doubles): exact up to 2**53, far beyond any Kafka partition.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from streamrec.cache.history_store import (
    AppendResult,
    History,
    HistoryEvent,
    HistoryStore,
    TopicPartition,
    UserId,
)
from streamrec.cache.stats import HistoryStoreStats
from streamrec.errors import ConfigError, StoreError

_TOKEN = struct.Struct("<qqq")
_TOTAL_FIELD = b"#total"
_DEFAULT_PREFIX = "streamrec:hist"

_APPEND_LUA = b"""
local max_bytes = tonumber(ARGV[1]) * 24
local marks = {}
local mark_text = {}
local applied = {}
for i = 2, #ARGV, 3 do
  local tp = ARGV[i]
  local off = tonumber(ARGV[i + 1])
  local mark = marks[tp]
  if mark == nil then
    mark = tonumber(redis.call('HGET', KEYS[2], tp) or '-1')
  end
  if off > mark then
    applied[#applied + 1] = ARGV[i + 2]
    marks[tp] = off
    mark_text[tp] = ARGV[i + 1]
  else
    marks[tp] = mark
  end
end
local n = #applied
if n > 0 then
  local len = redis.call('APPEND', KEYS[1], table.concat(applied))
  if len > max_bytes then
    redis.call('SET', KEYS[1], redis.call('GETRANGE', KEYS[1], len - max_bytes, -1))
  end
  local flat = {}
  for tp, text in pairs(mark_text) do
    flat[#flat + 1] = tp
    flat[#flat + 1] = text
  end
  redis.call('HSET', KEYS[2], unpack(flat))
  redis.call('HINCRBY', KEYS[2], '#total', n)
end
return n
"""
_APPEND_SHA = hashlib.sha1(_APPEND_LUA).hexdigest()


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisHistoryStore(HistoryStore):
    """``redis://host:port/db[?prefix=...]``; see the module docstring for the layout."""

    def __init__(self, url: str, max_seq_len: int) -> None:
        super().__init__(max_seq_len)
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError(f"history store URL {url!r} is not a redis:// URL")
        query = parse_qsl(parts.query, keep_blank_values=True)
        prefixes = [v for k, v in query if k == "prefix"]
        self.prefix = prefixes[-1] if prefixes else _DEFAULT_PREFIX
        if not self.prefix:
            raise ConfigError(f"history store URL {url!r}: prefix must not be empty")
        rest = urlencode([(k, v) for k, v in query if k != "prefix"])
        self.url = _redacted(url)
        try:
            self._client = aioredis.Redis.from_url(urlunsplit(parts._replace(query=rest)))
        except ValueError as exc:
            raise ConfigError(f"history store URL {self.url!r}: {exc}") from exc

    def _keys(self, user: UserId) -> tuple[str, str]:
        base = f"{self.prefix}:{{{user}}}"
        return f"{base}:t", f"{base}:w"

    async def append(self, batch: Sequence[HistoryEvent], scope: str = "") -> AppendResult:
        per_user: dict[UserId, list[bytes | int | str]] = {}
        fields: dict[tuple[str, int], str] = {}
        for user_id, topic, partition, offset, token in batch:
            args = per_user.setdefault(user_id, [self.max_seq_len])
            field = fields.get((topic, partition))
            if field is None:
                field = fields[(topic, partition)] = f"{topic}{scope}:{partition}"
            args.append(field)
            args.append(int(offset))
            args.append(_TOKEN.pack(int(token[0]), int(token[1]), int(token[2])))
        if not per_user:
            return AppendResult()
        try:
            counts = await self._run_appends(per_user)
        except RedisError as exc:
            raise StoreError(f"history store {self.url}: append failed: {exc}") from exc
        applied = {user: int(n) for user, n in zip(per_user, counts) if int(n) > 0}
        return self._counted(AppendResult(applied, len(batch) - sum(applied.values())))

    async def _run_appends(self, per_user: dict[UserId, list[bytes | int | str]]) -> list[int]:
        for attempt in range(2):
            async with self._client.pipeline(transaction=False) as pipe:
                for user, args in per_user.items():
                    pipe.evalsha(_APPEND_SHA, 2, *self._keys(user), *args)
                try:
                    return list(await pipe.execute())
                except NoScriptError:
                    if attempt:
                        raise
            # First use on this server (or it restarted): load and retry; idempotent.
            await self._client.script_load(_APPEND_LUA)
        raise AssertionError("unreachable")

    async def get(self, users: Sequence[UserId]) -> dict[UserId, History]:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for user in users:
                    tokens_key, marks_key = self._keys(user)
                    pipe.get(tokens_key)
                    pipe.hgetall(marks_key)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"history store {self.url}: get failed: {exc}") from exc
        out: dict[UserId, History] = {}
        for i, user in enumerate(users):
            raw, marks = replies[2 * i], replies[2 * i + 1]
            if not marks:
                out[user] = History.empty()
                continue
            table = np.frombuffer(raw or b"", dtype="<i8").reshape(-1, 3).astype(np.int64)
            watermarks: dict[TopicPartition, int] = {}
            for field_name, value in marks.items():
                if field_name != _TOTAL_FIELD:
                    topic, _, partition = field_name.decode().rpartition(":")
                    watermarks[(topic, int(partition))] = int(value)
            total = int(marks.get(_TOTAL_FIELD, 0))
            out[user] = History.from_table(table, watermarks, total)  # table [L, 3]
        return self._counted_gets(out)

    async def drop(self, users: Sequence[UserId]) -> None:
        """Nothing is held locally; the shared data stays for the users' new owner."""
        return None

    async def drop_partitions(self, tps: Collection[TopicPartition]) -> None:
        """Nothing is held locally (as ``drop``)."""
        return None

    async def delete(self, users: Sequence[UserId]) -> None:
        if not users:
            return
        keys = [key for user in users for key in self._keys(user)]
        try:
            await self._client.delete(*keys)
        except RedisError as exc:
            raise StoreError(f"history store {self.url}: delete failed: {exc}") from exc

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except RedisError as exc:
            raise StoreError(f"history store {self.url}: unreachable: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()

    def stats(self) -> HistoryStoreStats:
        return self._stats("redis", users=-1, nbytes=-1)  # shared: unknown here
