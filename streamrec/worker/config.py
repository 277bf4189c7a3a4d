"""The worker's whole configuration: frozen dataclasses, one section per layer.

Precedence, lowest first: dataclass defaults < TOML file < ``STREAMREC_*`` environment
variables < CLI flags. Every field is reachable from every layer under one naming scheme:

- TOML: a ``[section]`` table with ``field = value``, e.g. ``[kafka] bootstrap_servers``
- env:  ``STREAMREC_<SECTION>__<FIELD>``, e.g. ``STREAMREC_KAFKA__BOOTSTRAP_SERVERS``
- flag: ``--set section.field=value`` (plus named shortcuts in the CLI)

``STREAMREC_CONFIG`` names the TOML file when ``--config`` is not given. The layers are
read by ``config_sources.load_config``, the only place that reads environment variables;
everything else receives a ``WorkerConfig``.
Unknown keys are errors rather than warnings because a misspelt override silently running
with the default is the costlier failure in production.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from streamrec.errors import ConfigError
from streamrec.models.serving_precision import KV_DTYPES, WEIGHT_DTYPES, ServingPrecision
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.micro_batcher import BatcherConfig
from streamrec.pipeline.scoring_config import ScoringConfig

ENV_PREFIX = "STREAMREC_"
ENV_CONFIG_FILE = "STREAMREC_CONFIG"
SECRET_MASK = "***"
DEVICES = ("auto", "cpu", "cuda")  # model.device and every --device flag
MODEL_BACKENDS = ("auto", "aoti", "eager")  # model.backend

_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def _fail(section: str, name: str, value: object, problem: str) -> ConfigError:
    return ConfigError(f"{section}.{name} = {value!r}: {problem}")


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """Split ``X | None`` into ``(X, True)``; plain ``X`` into ``(X, False)``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config field type {tp!r}")
        return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    base, optional = unwrap_optional(tp)
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
    name = names.get(base, "a path")
    return f"{name} or unset" if optional else name


def matches_type(tp: Any, value: object) -> bool:
    base, optional = unwrap_optional(tp)
    if value is None:
        return optional
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if base is Path:
        return isinstance(value, Path)
    return isinstance(value, base)


@dataclass(frozen=True)
class Section:
    """Shared checks: every field has its declared type, then the section's own rules."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not matches_type(hints[f.name], value):
                raise _fail(self.SECTION, f.name, value, f"expected {type_name(hints[f.name])}")
        self._validate()

    def _validate(self) -> None:
        """Range and consistency rules of one section (overridden per section)."""

    def _require(self, ok: bool, name: str, problem: str) -> None:
        if not ok:
            raise _fail(self.SECTION, name, getattr(self, name), problem)

    def _positive(self, *names: str) -> None:
        for name in names:
            self._require(getattr(self, name) > 0, name, "must be > 0")

    def _one_of(self, name: str, allowed: tuple[str, ...]) -> None:
        self._require(getattr(self, name) in allowed, name, f"must be one of {list(allowed)}")


@dataclass(frozen=True)
class KafkaConfig(Section):
    """Connection to the Kafka cluster; the timeouts are passed to aiokafka unchanged."""

    SECTION: ClassVar[str] = "kafka"
    SECRETS: ClassVar[frozenset[str]] = frozenset({"sasl_password"})

    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "streamrec"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: Path | None = None
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    request_timeout_ms: int = 40_000
    # The broker holds an empty fetch this long: the latency floor of an idle partition
    # (the dev broker added ~75 ms to the p50 at 100). Lower costs idle fetch requests.
    fetch_max_wait_ms: int = 5
    fetch_max_bytes: int = 52_428_800
    max_partition_fetch_bytes: int = 1_048_576
    max_poll_records: int = 2_000
    # Output producer (recommendations and dead letters). Idempotence needs InitProducerId,
    # which the dev broker lacks, so it is opt-in.
    producer_linger_ms: int = 5
    producer_max_batch_bytes: int = 262_144
    producer_compression: str | None = None
    producer_idempotence: bool = False
    # Start-up: how long to back off at most between attempts while the broker is absent,
    # and how long a reachable cluster may lack an input topic (created by a job that runs
    # beside the worker, or not yet in every broker's metadata) before that is an error.
    connect_retry_max_s: float = 10.0
    topic_wait_s: float = 10.0

    def _validate(self) -> None:
        servers = self.bootstrap_servers.split(",")
        for server in servers:
            host, _, port = server.strip().rpartition(":")
            ok = bool(host) and port.isdigit() and 0 < int(port) < 65536
            self._require(ok, "bootstrap_servers", f"entry {server!r} is not host:port")
        self._require(bool(self.client_id), "client_id", "must not be empty")
        self._one_of("security_protocol", ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"))
        if self.security_protocol.startswith("SASL_"):
            self._require(self.sasl_mechanism is not None, "sasl_mechanism", "required with SASL_*")
        if self.sasl_mechanism is not None:
            self._one_of("sasl_mechanism", ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"))
            self._require(bool(self.sasl_username), "sasl_username", "required with SASL")
            self._require(self.sasl_password is not None, "sasl_password", "required with SASL")
        self._positive(
            "session_timeout_ms",
            "heartbeat_interval_ms",
            "max_poll_interval_ms",
            "request_timeout_ms",
            "fetch_max_bytes",
            "max_partition_fetch_bytes",
            "max_poll_records",
        )
        self._require(self.fetch_max_wait_ms >= 0, "fetch_max_wait_ms", "must be >= 0")
        self._require(self.producer_linger_ms >= 0, "producer_linger_ms", "must be >= 0")
        self._positive("producer_max_batch_bytes", "connect_retry_max_s")
        self._require(self.topic_wait_s >= 0, "topic_wait_s", "must be >= 0")
        if self.producer_compression is not None:
            self._one_of("producer_compression", ("gzip", "snappy", "lz4", "zstd"))
        self._require(
            self.heartbeat_interval_ms < self.session_timeout_ms,
            "heartbeat_interval_ms",
            f"must be < session_timeout_ms ({self.session_timeout_ms})",
        )
        self._require(
            self.request_timeout_ms > self.session_timeout_ms,
            "request_timeout_ms",
            f"must be > session_timeout_ms ({self.session_timeout_ms})",
        )

    def client_kwargs(self) -> dict[str, Any]:
        """Connection settings shared by aiokafka's consumer, producer and admin client."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        if self.sasl_mechanism is not None:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            cafile = str(self.ssl_cafile) if self.ssl_cafile is not None else None
            kwargs["ssl_context"] = create_ssl_context(cafile=cafile)
        return kwargs

    def consumer_kwargs(self) -> dict[str, Any]:
        """``client_kwargs`` plus the group-membership and fetch settings of a consumer."""
        return {
            **self.client_kwargs(),
            "session_timeout_ms": self.session_timeout_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "max_poll_interval_ms": self.max_poll_interval_ms,
            "fetch_max_wait_ms": self.fetch_max_wait_ms,
            "fetch_max_bytes": self.fetch_max_bytes,
            "max_partition_fetch_bytes": self.max_partition_fetch_bytes,
            "max_poll_records": self.max_poll_records,
        }


@dataclass(frozen=True)
class TopicsConfig(Section):
    """Topic names; playback and interaction must be co-partitioned (checked at start)."""

    SECTION: ClassVar[str] = "topics"

    playback: str = "playback-events"
    interaction: str = "interaction-events"
    output: str = "recommendations"
    dead_letter: str = "streamrec-dlq"
    output_format: str = "msgpack"
    max_record_bytes: int = 65_536  # larger input records are dead-lettered as oversized
    # An event time further than this ahead of the worker's wall clock is dead-lettered as
    # out_of_range: it would pin ``last_event_ts_ms`` and the time bias in the future.
    max_future_skew_ms: int = 86_400_000

    def _validate(self) -> None:
        self._positive("max_record_bytes", "max_future_skew_ms")
        names = ("playback", "interaction", "output", "dead_letter")
        for name in names:
            topic = getattr(self, name)
            ok = _TOPIC_NAME.match(topic) is not None and topic not in (".", "..")
            self._require(ok, name, "is not a legal Kafka topic name ([A-Za-z0-9._-]{1,249})")
        seen: dict[str, str] = {}
        for name in names:
            other = seen.setdefault(getattr(self, name), name)
            self._require(other == name, name, f"is the same topic as topics.{other}")
        self._one_of("output_format", ("msgpack", "json"))

    def input_topics(self) -> tuple[str, str]:
        return (self.playback, self.interaction)


@dataclass(frozen=True)
class GroupConfig(Section):
    """Consumer-group membership and the commit cadence."""

    SECTION: ClassVar[str] = "group"

    group_id: str = "streamrec"
    group_instance_id: str | None = None
    commit_interval_ms: int = 1_000
    drain_timeout_s: float = 10.0

    def _validate(self) -> None:
        self._require(bool(self.group_id), "group_id", "must not be empty")
        if self.group_instance_id is not None:
            self._require(bool(self.group_instance_id), "group_instance_id", "must not be empty")
        self._positive("commit_interval_ms", "drain_timeout_s")


@dataclass(frozen=True)
class CacheConfig(Section):
    """Cache sizes. ``kv_budget_bytes`` = 0 means: use ``kv_budget_fraction`` of the GPU
    memory left free after the model is loaded (so one config fits several GPU sizes)."""

    SECTION: ClassVar[str] = "cache"

    kv_budget_bytes: int = 0
    kv_budget_fraction: float = 0.5
    block_size: int = 16
    host_tier_bytes: int = 1 << 30
    # Catalogues past the GPU budget (issue 20): hot item rows on the device, the table in
    # host memory, retrieval over the most popular items, refreshed while serving.
    embedding_cache_rows: int = 0  # 0 (or >= the table) = the whole item table on the device
    retrievable_items: int = 1_000_000  # with the embedding cache: items retrieval scores
    popularity_half_life_events: float = 1_000_000.0
    retrievable_refresh_events: int = 100_000
    # Disk KV tier behind the host tier (GPU workers; 0 = none); its files are removed at
    # start and at exit, so give every worker process of a host its own directory.
    disk_tier_bytes: int = 0
    disk_tier_dir: Path = Path(".streamrec-cache/disk-kv")
    disk_tier_fsync: bool = False
    # GPU buffers of one max-length user each that disk reads are copied into as they land
    # (no host->device copy in the step); on top of the KV budget. 0 = none.
    disk_tier_device_slots: int = 4
    kv_dtype: str = "model"  # "fp8_e4m3": K/V as e4m3 codes, half the bytes (models/fp8.py)

    def _validate(self) -> None:
        self._one_of("kv_dtype", KV_DTYPES)
        self._require(self.kv_budget_bytes >= 0, "kv_budget_bytes", "must be >= 0")
        self._require(
            0.0 < self.kv_budget_fraction <= 1.0, "kv_budget_fraction", "must be in (0, 1]"
        )
        self._require(
            0 < self.block_size <= 4096 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            "must be a power of two in [1, 4096]",
        )
        self._require(self.host_tier_bytes >= 0, "host_tier_bytes", "must be >= 0")
        self._require(self.embedding_cache_rows >= 0, "embedding_cache_rows", "must be >= 0")
        self._positive(
            "retrievable_items", "popularity_half_life_events", "retrievable_refresh_events"
        )
        self._require(self.disk_tier_bytes >= 0, "disk_tier_bytes", "must be >= 0")
        self._require(
            self.disk_tier_bytes == 0 or self.host_tier_bytes > 0,
            "disk_tier_bytes",
            "needs a host tier in front of it (host_tier_bytes > 0)",
        )
        self._require(str(self.disk_tier_dir) != "", "disk_tier_dir", "must not be empty")
        self._require(self.disk_tier_device_slots >= 0, "disk_tier_device_slots", "must be >= 0")


@dataclass(frozen=True)
class ModelConfig(Section):
    """Which model to serve and how.

    ``backend``: ``auto`` serves the AOTI package whose key matches, else the eager module
    (a warning, and ``streamrec_model_backend{backend="eager_fallback"}``); ``aoti`` makes
    a missing package a start-up error; ``eager`` serves the eager module and opens no
    package (no compile step; on the H200 the AOTI package in CUDA graphs is the faster
    worker path: BENCHMARKS.md, issue 15).

    ``cuda_graphs`` (CUDA, either backend) replays extend, retrieve and rank as CUDA
    graphs captured at start for batch buckets, up to ``graph_max_tokens`` new tokens per
    step; larger steps run directly. Buckets are powers of two up to 32, then
    ``graph_buckets_per_octave`` sizes per doubling (4: 40, 48, 56, 64, 80, ...): a step
    costs what its bucket costs, so finer buckets waste less on padding (at most 25 % at
    4) for one more captured graph each (1 = powers of two only).
    """

    SECTION: ClassVar[str] = "model"

    model_dir: Path = Path(".streamrec-cache/model")
    backend: str = "auto"
    aoti_cache_dir: Path = Path(".streamrec-cache/aoti")
    device: str = "auto"
    cuda_graphs: bool = True
    graph_max_tokens: int = 4096
    graph_buckets_per_octave: int = 4
    # torch's intra-op threads in the worker process; 0 = 1 on CUDA, torch's default on the
    # CPU (model_loader.host_threads says why)
    host_threads: int = 0
    weight_dtype: str = "model"  # "fp8": the layers' GEMMs in e4m3 (models/fp8_linear.py)
    # Most history tokens one jagged prefill call takes (rebuilt users, consecutive);
    # 0 = the engine's default (model_step.PREFILL_CALL_TOKENS): a call's activations grow
    # with it, fewer calls cost fewer partial tiles (BENCHMARKS.md, issue 14).
    prefill_call_tokens: int = 0

    def _validate(self) -> None:
        self._require(str(self.model_dir) != "", "model_dir", "must not be empty")
        self._one_of("device", DEVICES)
        self._one_of("backend", MODEL_BACKENDS)
        self._one_of("weight_dtype", WEIGHT_DTYPES)
        self._positive("graph_max_tokens", "graph_buckets_per_octave")
        self._require(self.host_threads >= 0, "host_threads", "must be >= 0 (0 = automatic)")
        self._require(
            self.prefill_call_tokens >= 0, "prefill_call_tokens", "must be >= 0 (0 = default)"
        )


@dataclass(frozen=True)
class StoreConfig(Section):
    """History store; the URL scheme picks the backend (``memory://`` or ``redis://``)."""

    SECTION: ClassVar[str] = "store"
    SECRETS: ClassVar[frozenset[str]] = frozenset({"url"})  # only its password part

    url: str = "memory://"

    def _validate(self) -> None:
        scheme = urlsplit(self.url).scheme
        self._require(
            scheme in ("memory", "redis", "rediss"), "url", "scheme must be memory, redis or rediss"
        )


@dataclass(frozen=True)
class HttpConfig(Section):
    """The one HTTP port for /metrics, /healthz and /readyz (port 0 = pick a free one)."""

    SECTION: ClassVar[str] = "http"

    host: str = "0.0.0.0"
    port: int = 9400
    # /healthz fails when the consume loop has not made progress for this long.
    stall_timeout_s: float = 60.0

    def _validate(self) -> None:
        self._require(bool(self.host), "host", "must not be empty")
        self._positive("stall_timeout_s")
        self._require(0 <= self.port <= 65535, "port", "must be in [0, 65535]")


@dataclass(frozen=True)
class LogConfig(Section):
    """Log format: ``auto`` is text on a terminal and JSON lines otherwise (containers)."""

    SECTION: ClassVar[str] = "log"

    format: str = "auto"
    level: str = "INFO"

    def _validate(self) -> None:
        self._one_of("format", ("auto", "json", "text"))
        self._require(
            self.level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
            "level",
            "must be DEBUG, INFO, WARNING, ERROR or CRITICAL",
        )


# Section name -> its class. ``batching``, ``scoring`` and ``generation`` are the pipeline's
# own configs: each knob is defined and validated once, where it is used.
SECTIONS: dict[str, type[Any]] = {
    "kafka": KafkaConfig,
    "topics": TopicsConfig,
    "group": GroupConfig,
    "batching": BatcherConfig,
    "scoring": ScoringConfig,
    "cache": CacheConfig,
    "model": ModelConfig,
    "generation": GenerationConfig,
    "store": StoreConfig,
    "http": HttpConfig,
    "log": LogConfig,
}
_SCALARS = (bool, int, float, str, Path)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs; built by ``load_config``, passed by constructor."""

    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    batching: BatcherConfig = field(default_factory=BatcherConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigError(f"{name} = {value!r}: expected a {cls.__name__}")
        if self.batching.max_batch_users > self.batching.queue_high_watermark:
            raise ConfigError(
                f"batching.max_batch_users = {self.batching.max_batch_users}: must be <= "
                f"batching.queue_high_watermark ({self.batching.queue_high_watermark})"
            )

    @property
    def precision(self) -> ServingPrecision:
        """``cache.kv_dtype`` and ``model.weight_dtype``: what the loaded model is turned into."""
        return ServingPrecision(self.cache.kv_dtype, self.model.weight_dtype)

    def to_dict(self, *, mask_secrets: bool = True) -> dict[str, dict[str, Any]]:
        """Plain nested dict of the configurable fields (paths as strings); secrets masked
        unless asked otherwise."""
        out: dict[str, dict[str, Any]] = {}
        for name, cls in SECTIONS.items():
            section = getattr(self, name)
            secrets: frozenset[str] = getattr(cls, "SECRETS", frozenset())
            values: dict[str, Any] = {}
            for f in loadable_fields(cls):
                value = getattr(section, f.name)
                if isinstance(value, Path):
                    value = str(value)
                if mask_secrets and f.name in secrets and value is not None:
                    value = _mask_url(value) if f.name == "url" else SECRET_MASK
                values[f.name] = value
            out[name] = values
        return out


def loadable_fields(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    """The fields a file, the environment or a flag can set: scalars (and optional ones).
    Others (``scoring.task_weights``) keep their defaults."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if unwrap_optional(hints[f.name])[0] in _SCALARS]


def _mask_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:{SECRET_MASK}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class FieldInfo:
    """One configurable field: where it lives and how to set it (drives docs and `--set`)."""

    section: str
    name: str
    type_name: str
    default: object

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return env_var_name(self.section, self.name)


def env_var_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}__{name.upper()}"


def config_fields() -> list[FieldInfo]:
    """Every field of every section, in declaration order."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in loadable_fields(cls):
            out.append(FieldInfo(section, f.name, type_name(hints[f.name]), f.default))
    return out
