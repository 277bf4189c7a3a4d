"""Fixtures of the cache tests: a real Redis (never mocked) under a throw-away key prefix."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_reachable() -> str | None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        return f"Redis at {REDIS_URL} is unreachable: {exc}"
    return None


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    """A ``redis://`` store URL with a unique prefix; its keys are deleted afterwards."""
    reason = _redis_reachable()
    if reason is not None:
        pytest.skip(reason)
    prefix = f"streamrec-test-{uuid.uuid4().hex}"
    yield f"{REDIS_URL}?prefix={prefix}"
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()  # type: ignore[attr-defined]  # stale types-redis stubs
