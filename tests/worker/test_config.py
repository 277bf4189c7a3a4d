from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from streamrec.errors import ConfigError
from streamrec.models.serving_precision import ServingPrecision
from streamrec.pipeline.generation_config import GenerationConfig
from streamrec.pipeline.scoring_config import ScoringConfig
from streamrec.worker.config import (
    SECRET_MASK,
    CacheConfig,
    GroupConfig,
    HttpConfig,
    KafkaConfig,
    LogConfig,
    ModelConfig,
    StoreConfig,
    TopicsConfig,
    WorkerConfig,
    config_fields,
)
from streamrec.worker.config_sources import load_config

NO_ENV: dict[str, str] = {}


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "streamrec.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source() -> None:
    config = load_config(environ=NO_ENV)
    assert config == WorkerConfig()
    assert config.topics.playback == "playback-events"
    assert config.topics.interaction == "interaction-events"
    assert config.topics.output == "recommendations"
    assert config.topics.dead_letter == "streamrec-dlq"
    assert config.group.group_id == "streamrec"
    assert config.store.url == "memory://"
    assert config.http.port == 9400


def test_precedence_defaults_toml_env_flags(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
        [http]
        port = 1001
        host = "127.0.0.1"
        [group]
        group_id = "from-file"
        commit_interval_ms = 250
        [kafka]
        client_id = "file-client"
        """,
    )
    environ = {"STREAMREC_HTTP__PORT": "1002", "STREAMREC_GROUP__GROUP_ID": "from-env"}
    overrides = {"http.port": "1003"}
    config = load_config(path, environ=environ, overrides=overrides)
    assert config.http.port == 1003  # flag beats env beats file
    assert config.group.group_id == "from-env"  # env beats file
    assert config.group.commit_interval_ms == 250  # file beats default
    assert config.http.host == "127.0.0.1"
    assert config.kafka.client_id == "file-client"
    assert config.kafka.bootstrap_servers == "127.0.0.1:9092"  # default


def test_config_file_from_environment_and_explicit_path_wins(tmp_path: Path) -> None:
    env_file = write_toml(tmp_path, "[http]\nport = 2001\n")
    other = tmp_path / "other.toml"
    other.write_text("[http]\nport = 2002\n")
    assert load_config(environ={"STREAMREC_CONFIG": str(env_file)}).http.port == 2001
    assert load_config(other, environ={"STREAMREC_CONFIG": str(env_file)}).http.port == 2002


def test_every_field_reachable_from_env_and_overrides() -> None:
    # Set each field to its own default through each layer: every name must be accepted.
    for info in config_fields():
        default = info.default
        if default is None or isinstance(default, bool):
            text = "" if default is None else str(default).lower()
        else:
            text = str(default)
        from_env = load_config(environ={info.env_var: text})
        from_flag = load_config(environ=NO_ENV, overrides={info.key: text})
        assert from_env == WorkerConfig() == from_flag, info.key


def test_env_values_are_parsed_by_field_type() -> None:
    environ = {
        "STREAMREC_MODEL__BACKEND": "aoti",
        "STREAMREC_BATCHING__MAX_WAIT_MS": "2.5",
        "STREAMREC_CACHE__HOST_TIER_BYTES": "2_000_000",
        "STREAMREC_MODEL__MODEL_DIR": "/models/x",
        "STREAMREC_GROUP__GROUP_INSTANCE_ID": "worker-0",
    }
    config = load_config(environ=environ)
    assert config.model.backend == "aoti"
    assert config.batching.max_wait_ms == 2.5
    assert config.cache.host_tier_bytes == 2_000_000
    assert config.model.model_dir == Path("/models/x")
    assert config.group.group_instance_id == "worker-0"


def test_toml_int_accepted_for_float_field_and_str_for_path(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[group]\ndrain_timeout_s = 3\n[model]\nmodel_dir = "m"\n')
    config = load_config(path, environ=NO_ENV)
    assert config.group.drain_timeout_s == 3.0
    assert isinstance(config.group.drain_timeout_s, float)
    assert config.model.model_dir == Path("m")


@pytest.mark.parametrize(
    ("source", "payload", "needles"),
    [
        ("toml", "[kafka]\nbootstrap_servers = 'nohost'\n", ["bootstrap_servers", "'nohost'"]),
        ("toml", "[http]\nport = '80'\n", ["http.port", "'80'", "integer"]),
        ("toml", "[http]\nport = 70000\n", ["http.port", "70000"]),
        ("toml", "[model]\nbackend = 1\n", ["model.backend", "1", "string"]),
        ("env", {"STREAMREC_HTTP__PORT": "eighty"}, ["STREAMREC_HTTP__PORT", "'eighty'"]),
        ("env", {"STREAMREC_MODEL__BACKEND": "maybe"}, ["backend", "'maybe'"]),
        ("env", {"STREAMREC_BATCHING__MAX_WAIT_MS": "-1"}, ["batching.max_wait_ms", "-1.0"]),
        ("env", {"STREAMREC_TOPICS__OUTPUT_FORMAT": "avro"}, ["topics.output_format", "'avro'"]),
        ("env", {"STREAMREC_MODEL__DEVICE": "tpu"}, ["model.device", "'tpu'"]),
        (
            "env",
            {"STREAMREC_MODEL__PREFILL_CALL_TOKENS": "-1"},
            ["model.prefill_call_tokens", "-1"],
        ),
        ("env", {"STREAMREC_CACHE__KV_DTYPE": "int8"}, ["cache.kv_dtype", "'int8'", "fp8_e4m3"]),
        ("flag", {"model.weight_dtype": "fp4"}, ["model.weight_dtype", "'fp4'", "fp8"]),
        ("env", {"STREAMREC_LOG__LEVEL": "LOUD"}, ["log.level", "'LOUD'"]),
        ("env", {"STREAMREC_STORE__URL": "mysql://x"}, ["store.url", "'mysql://x'"]),
        ("flag", {"cache.block_size": "12"}, ["cache.block_size", "12", "power of two"]),
        ("flag", {"cache.kv_budget_fraction": "1.5"}, ["kv_budget_fraction", "1.5"]),
        ("flag", {"topics.output": "bad topic"}, ["topics.output", "'bad topic'"]),
        ("flag", {"topics.output": "playback-events"}, ["topics.output", "topics.playback"]),
        ("flag", {"scoring.top_k": "500"}, ["scoring.num_candidates", "200", "top_k (500)"]),
        ("flag", {"batching.max_batch_users": "0"}, ["batching.max_batch_users", "0"]),
        (
            "flag",
            {"batching.max_batch_users": "9000"},
            ["batching.max_batch_users", "9000", "queue_high_watermark"],
        ),
        ("flag", {"group.commit_interval_ms": "0"}, ["group.commit_interval_ms", "0"]),
        (
            "flag",
            {"batching.queue_low_watermark": "9000"},
            ["batching.queue_low_watermark", "9000", "queue_high_watermark"],
        ),
        (
            "flag",
            {"kafka.heartbeat_interval_ms": "20000"},
            ["heartbeat_interval_ms", "20000", "session_timeout_ms"],
        ),
        (
            "flag",
            {"kafka.security_protocol": "SASL_SSL"},
            ["kafka.sasl_mechanism", "None", "SASL"],
        ),
    ],
)
def test_bad_values_name_field_and_value(
    tmp_path: Path, source: str, payload: object, needles: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        if source == "toml":
            assert isinstance(payload, str)
            load_config(write_toml(tmp_path, payload), environ=NO_ENV)
        elif source == "env":
            assert isinstance(payload, dict)
            load_config(environ=payload)
        else:
            assert isinstance(payload, dict)
            load_config(environ=NO_ENV, overrides=payload)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.parametrize(
    ("section", "kwargs", "needles"),
    [
        (KafkaConfig, {"session_timeout_ms": -5}, ["kafka.session_timeout_ms", "-5"]),
        (KafkaConfig, {"client_id": 3}, ["kafka.client_id", "3", "string"]),
        (TopicsConfig, {"playback": ""}, ["topics.playback", "''"]),
        (GroupConfig, {"group_id": ""}, ["group.group_id", "''"]),
        (ScoringConfig, {"top_k": 0}, ["top_k", "0"]),
        (CacheConfig, {"kv_budget_bytes": -1}, ["cache.kv_budget_bytes", "-1"]),
        (ModelConfig, {"model_dir": "str-not-path"}, ["model.model_dir", "path"]),
        (StoreConfig, {"url": "file:///x"}, ["store.url", "'file:///x'"]),
        (HttpConfig, {"port": True}, ["http.port", "True", "integer"]),
        (LogConfig, {"format": "xml"}, ["log.format", "'xml'"]),
        (GenerationConfig, {"k": -1}, ["k = -1"]),
        (GenerationConfig, {"gamma": 0}, ["gamma = 0"]),
        (GenerationConfig, {"top_p": 0.0}, ["top_p = 0.0"]),
        (GenerationConfig, {"action": "candidate"}, ["action = 'candidate'"]),
        (GenerationConfig, {"draft_model": Path("d")}, ["draft_model", "k >= 1"]),
    ],
)
def test_direct_construction_is_validated(
    section: type, kwargs: dict[str, object], needles: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        section(**kwargs)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_precision_comes_from_the_cache_and_model_sections() -> None:
    config = load_config(
        environ={"STREAMREC_CACHE__KV_DTYPE": "fp8_e4m3"},
        overrides={"model.weight_dtype": "fp8"},
    )
    assert config.precision == ServingPrecision(kv_dtype="fp8_e4m3", weight_dtype="fp8")
    assert load_config(environ=NO_ENV).precision == ServingPrecision()


def test_worker_config_rejects_wrong_section_type() -> None:
    with pytest.raises(ConfigError, match="kafka"):
        WorkerConfig(kafka=HttpConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[kafka]\nbootstrap = 'x:1'\n", "'kafka.bootstrap'"),
        ("[kafak]\nclient_id = 'x'\n", "[kafak]"),
        ("port = 1\n", "[port]"),
    ],
)
def test_unknown_toml_keys_are_rejected(tmp_path: Path, toml: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_toml(tmp_path, toml), environ=NO_ENV)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "var", ["STREAMREC_HTTP__PROT", "STREAMREC_BOOTSTRAP_SERVERS", "STREAMREC_NOPE__X"]
)
def test_unknown_env_vars_are_rejected(var: str) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config(environ={var: "1"})


def test_unrelated_env_vars_are_ignored() -> None:
    assert load_config(environ={"HOME": "/root", "STREAMRECX": "1"}) == WorkerConfig()


def test_unknown_override_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"'http\.prot'"):
        load_config(environ=NO_ENV, overrides={"http.prot": "1"})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", environ=NO_ENV)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write_toml(tmp_path, "[http\n"), environ=NO_ENV)


def test_to_dict_masks_secrets_and_is_plain() -> None:
    environ = {
        "STREAMREC_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "STREAMREC_KAFKA__SASL_MECHANISM": "PLAIN",
        "STREAMREC_KAFKA__SASL_USERNAME": "svc",
        "STREAMREC_KAFKA__SASL_PASSWORD": "hunter2",
        "STREAMREC_STORE__URL": "redis://user:pw123@cache:6380/2",
    }
    config = load_config(environ=environ)
    shown = config.to_dict()
    assert shown["kafka"]["sasl_password"] == SECRET_MASK
    assert shown["kafka"]["sasl_username"] == "svc"
    assert shown["store"]["url"] == f"redis://user:{SECRET_MASK}@cache:6380/2"
    assert "hunter2" not in repr(shown) and "pw123" not in repr(shown)
    assert shown["model"]["model_dir"] == ".streamrec-cache/model"
    raw = config.to_dict(mask_secrets=False)
    assert raw["kafka"]["sasl_password"] == "hunter2"
    assert set(shown) == {f.section for f in config_fields()}


def test_client_kwargs_carry_security_settings() -> None:
    kafka = KafkaConfig(
        bootstrap_servers="a:1,b:2",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="u",
        sasl_password="p",
    )
    kwargs = kafka.client_kwargs()
    assert kwargs["bootstrap_servers"] == "a:1,b:2"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-256"
    assert kwargs["sasl_plain_password"] == "p"
    consumer = kafka.consumer_kwargs()
    assert consumer["session_timeout_ms"] == kafka.session_timeout_ms
    assert consumer["max_poll_records"] == kafka.max_poll_records


def test_configs_are_frozen() -> None:
    config = WorkerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.http.port = 1  # type: ignore[misc]


def test_generation_section_from_env_and_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[generation]\nk = 10\ndraft_model = "models/draft"\n')
    env = {"STREAMREC_GENERATION__TEMPERATURE": "0.7", "STREAMREC_GENERATION__ACTION": "like"}
    gen = load_config(path, environ=env).generation
    assert (gen.k, gen.draft_model, gen.gamma) == (10, Path("models/draft"), 4)
    assert (gen.temperature, gen.action, gen.exclude_consumed) == (0.7, "like", True)
    assert load_config(environ=NO_ENV).generation.k == 0  # off by default
    with pytest.raises(ConfigError, match=r"generation\.gamma = 0"):
        load_config(environ={"STREAMREC_GENERATION__GAMMA": "0"})
