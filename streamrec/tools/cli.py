"""The ``streamrec`` command line.

Each subcommand is one handler taking the parsed namespace and returning an exit status.
Exit statuses: 0 success, 1 failure (bad input lines, unreachable broker, bad config,
a failed export), 2 usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from streamrec import __version__
from streamrec.errors import ConfigError, StreamrecError
from streamrec.offline.training import TrainConfig
from streamrec.tools.export_command import add_export_arguments, run_export
from streamrec.tools.supervisor import add_supervisor_arguments, run_supervised, supervising
from streamrec.worker.config import ENV_CONFIG_FILE, WorkerConfig, config_fields, load_config
from streamrec.worker.model_loader import export_config_for

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2

Handler = Callable[[argparse.Namespace], int]

# ``streamrec bench NAME`` -> the module under bench/ whose ``main(argv)`` runs it.
BENCHMARKS: Final = {
    "engine": "bench.engine_bench",
    "cache-capacity": "bench.cache_capacity",
    "decode": "bench.decode_bench",
    "history-store": "bench.history_store_bench",
    "host-tier": "bench.host_tier_bench",
    "aoti": "bench.aoti_bench",
    "h200": "bench.h200_bench",
    "soak": "bench.soak",
    "cpu-vs-naive": "bench.cpu_worker_vs_naive",
}

# Named flags -> config keys (everything else: --set section.field=value).
_FLAG_KEYS: Final = {
    "bootstrap_servers": "kafka.bootstrap_servers",
    "group_id": "group.group_id",
    "output_topic": "topics.output",
    "dlq_topic": "topics.dead_letter",
    "model": "model.model_dir",
    "store": "store.url",
    "http_port": "http.port",
    "log_format": "log.format",
    "log_level": "log.level",
}


def _add_config_flags(parser: argparse.ArgumentParser, *, worker: bool) -> None:
    """The flags that override the config file and the environment."""
    group = parser.add_argument_group("configuration (flags beat STREAMREC_* env beat file)")
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"TOML config file (default: ${ENV_CONFIG_FILE})",
    )
    group.add_argument("--bootstrap-servers", metavar="HOST:PORT[,...]")
    if worker:
        group.add_argument("--group-id")
        group.add_argument(
            "--input-topics", metavar="PLAYBACK,INTERACTION", help="the two input topics"
        )
        group.add_argument("--output-topic")
        group.add_argument("--dlq-topic")
        group.add_argument("--model", metavar="DIR", help="model directory")
        group.add_argument("--store", metavar="URL", help="history store: memory:// or redis://")
        group.add_argument("--http-port", metavar="PORT")
        group.add_argument(
            "--require-aoti",
            action="store_true",
            default=None,
            help="fail instead of falling back to eager PyTorch",
        )
    group.add_argument("--log-format", choices=("auto", "json", "text"))
    group.add_argument("--log-level", metavar="LEVEL")
    group.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="set any config field (repeatable); see `streamrec config show`",
    )


def config_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config overrides that the parsed flags ask for (dotted key -> text)."""
    overrides: dict[str, str] = {}
    for setting in getattr(args, "settings", []):
        key, sep, value = setting.partition("=")
        if not sep:
            raise ConfigError(f"--set {setting!r}: expected SECTION.FIELD=VALUE")
        overrides[key.strip()] = value
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = str(value)
    topics = getattr(args, "input_topics", None)
    if topics is not None:
        names = [name.strip() for name in topics.split(",")]
        if len(names) != 2:
            raise ConfigError(
                f"--input-topics {topics!r}: expected two names, PLAYBACK,INTERACTION"
            )
        overrides["topics.playback"], overrides["topics.interaction"] = names
    if getattr(args, "require_aoti", None):
        overrides["model.require_aoti"] = "true"
    return overrides


def effective_config(args: argparse.Namespace) -> WorkerConfig:
    return load_config(getattr(args, "config", None), overrides=config_overrides(args))


def _export(args: argparse.Namespace) -> int:
    """``streamrec export``: flags beat the worker config, so the package the worker
    looks for (model dir, cache dir, device, retrieve k) is the one that gets built."""
    config = effective_config(args)
    model_cfg = config.model
    if args.model_dir is None:
        args.model_dir = model_cfg.model_dir
    if args.cache_dir is None:
        args.cache_dir = model_cfg.aoti_cache_dir
    if args.device is None:
        args.device = model_cfg.device
    if args.retrieve_k is None:
        args.retrieve_k = export_config_for(config.scoring).retrieve_k
    return run_export(args)


def _bench(args: argparse.Namespace) -> int:
    """Benchmarks live in the repository's ``bench/`` (not installed): run from a checkout."""
    module = BENCHMARKS[args.name]
    if not (Path.cwd() / "bench" / "__init__.py").is_file():
        print(
            f"bench {args.name}: no bench/ here ({Path.cwd()}); run it from the root of a "
            "streamrec source checkout",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return subprocess.call([sys.executable, "-m", module, *args.bench_args])


def _config_show(args: argparse.Namespace) -> int:
    config = effective_config(args)
    data = config.to_dict(mask_secrets=not args.show_secrets)
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(render_toml(data))
    return EXIT_OK


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def render_toml(data: dict[str, dict[str, Any]]) -> str:
    """TOML for the effective config; unset optional fields appear commented out."""
    env_names = {(f.section, f.name): f.env_var for f in config_fields()}
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for name, value in values.items():
            env = env_names[(section, name)]
            if value is None:
                lines.append(f"# {name} = (unset)  # {env}")
            else:
                lines.append(f"{name} = {_toml_value(value)}  # {env}")
        lines.append("")
    return "\n".join(lines)


def _produce(args: argparse.Namespace) -> int:
    from streamrec.schemas.wire import WireFormat
    from streamrec.tools.produce_command import kind_for_topic, produce_stream

    config = effective_config(args)
    kind = kind_for_topic(args.topic, config.topics, args.kind)
    fmt = WireFormat.JSON if args.format == "json" else WireFormat.MSGPACK
    try:
        stream = args.file.open("rb") if args.file is not None else sys.stdin.buffer
    except OSError as exc:
        raise ConfigError(f"--file {str(args.file)!r}: {exc.strerror}") from None
    try:
        stats = asyncio.run(
            produce_stream(
                stream,
                topic=args.topic,
                kind=kind,
                kafka=config.kafka,
                fmt=fmt,
                key_field=args.key_field,
            )
        )
    finally:
        if args.file is not None:
            stream.close()
    for error in stats.errors:
        print(f"streamrec produce: {error}", file=sys.stderr)
    print(
        f"streamrec produce: sent {stats.sent} to {args.topic!r} ({kind.value}, {fmt.name.lower()})"
        f", {stats.invalid} invalid, {stats.blank} blank",
        file=sys.stderr,
    )
    return EXIT_FAILURE if stats.invalid else EXIT_OK


def _run(args: argparse.Namespace) -> int:
    """The worker until SIGTERM/SIGINT (then drain, flush, commit, exit 0); with ``--gpus``
    (or ``--cpu-children``) a supervisor of one such worker per GPU."""
    if supervising(args):
        return run_supervised(effective_config(args), args)
    import signal

    import uvloop

    from streamrec.worker.app import App
    from streamrec.worker.logging_setup import configure_logging

    config = effective_config(args)
    configure_logging(config.log)

    async def serve() -> int:
        app = App(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, app.stop)
        return await app.run()

    return uvloop.run(serve())


def _demo(args: argparse.Namespace) -> int:
    from streamrec.tools.demo import DemoConfig, run_demo
    from streamrec.worker.config import LogConfig
    from streamrec.worker.logging_setup import configure_logging

    configure_logging(LogConfig(format="text", level=args.log_level))
    cfg = DemoConfig(
        events=args.num_events,
        rate=args.rate,
        partitions=args.partitions,
        model_dir=args.model,
        events_file=args.events,
        watch_users=args.watch,
    )
    asyncio.run(run_demo(cfg))
    return EXIT_OK


def _training_data(args: argparse.Namespace) -> Any:
    from streamrec.offline.datasets import SyntheticSpec, read_movielens, synthetic_log

    if args.events is not None:
        return read_movielens(args.events)
    return synthetic_log(SyntheticSpec(seed=args.seed))


def _train(args: argparse.Namespace) -> int:
    from streamrec.offline.training import train

    config = TrainConfig(
        epochs=args.epochs,
        seed=args.seed,
        device=args.device,
        max_seq_len=args.max_seq_len,
        seq_len=min(args.max_seq_len, TrainConfig.seq_len),
    )
    result = train(_training_data(args), args.out, config)
    print(
        f"streamrec train: wrote {result.model_dir} (model_version {result.model_version}, "
        f"{result.steps} steps, loss {result.final_loss:.4f}, {result.seconds:.1f} s)"
    )
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from streamrec.offline.evaluation import evaluate

    evaluate(
        args.model,
        _training_data(args),
        k=args.k,
        exclude_history=args.exclude_history,
        device=args.device,
    )
    return EXIT_OK


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--synthetic", action="store_true", help="synthetic data (the default)")
    data.add_argument(
        "--ratings", "--events", dest="events", type=Path, metavar="RATINGS_CSV",
        help="MovieLens-format ratings.csv (userId,movieId,rating,timestamp)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description="Streaming generative recommendations: Kafka events -> HSTU -> top-K.",
    )
    parser.add_argument("--version", action="version", version=f"streamrec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the worker against a Kafka cluster")
    _add_config_flags(run, worker=True)
    add_supervisor_arguments(run)
    run.set_defaults(handler=_run)

    demo = sub.add_parser("demo", help="local broker + small model + replayed events")
    demo.add_argument("--model", type=Path, metavar="DIR", help="serve this model (else train)")
    demo.add_argument("--events", type=Path, metavar="RATINGS_CSV", help="MovieLens ratings.csv")
    demo.add_argument("--num-events", type=int, default=5_000, help="events to replay")
    demo.add_argument("--rate", type=float, default=1_000.0, help="events/s (0 = unpaced)")
    demo.add_argument("--partitions", type=int, default=4)
    demo.add_argument("--watch", type=int, default=3, help="users whose updates are printed")
    demo.add_argument("--log-level", default="WARNING")
    demo.set_defaults(handler=_demo)

    train = sub.add_parser("train", help="train a model directory")
    train.add_argument("--out", type=Path, required=True, metavar="DIR")
    train.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    train.add_argument("--max-seq-len", type=int, default=TrainConfig.max_seq_len)
    _add_data_flags(train)
    train.set_defaults(handler=_train)

    evaluation = sub.add_parser("eval", help="evaluate a model directory offline")
    evaluation.add_argument("--model", type=Path, required=True, metavar="DIR")
    evaluation.add_argument("--k", type=int, default=10)
    evaluation.add_argument("--exclude-history", action="store_true")
    _add_data_flags(evaluation)
    evaluation.set_defaults(handler=_eval)

    export = sub.add_parser("export", help="compile a model to an AOTInductor package")
    _add_config_flags(export, worker=False)
    add_export_arguments(export)
    export.set_defaults(handler=_export, model_dir=None, cache_dir=None, device=None)
    export.set_defaults(retrieve_k=None)

    bench = sub.add_parser("bench", help="run a benchmark of bench/ (source checkout)")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="its own flags")
    bench.set_defaults(handler=_bench)

    config = sub.add_parser("config", help="inspect the configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the effective configuration")
    _add_config_flags(show, worker=True)
    show.add_argument("--format", choices=("toml", "json"), default="toml")
    show.add_argument("--show-secrets", action="store_true", help="do not mask passwords")
    show.set_defaults(handler=_config_show)

    produce = sub.add_parser("produce", help="send JSON-lines events to a topic")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--file", type=Path, help="JSON-lines file (default: stdin)")
    produce.add_argument("--format", choices=("msgpack", "json"), default="msgpack")
    produce.add_argument(
        "--kind",
        choices=("playback", "interaction"),
        help="event schema (default: by topic name from the config)",
    )
    produce.add_argument("--key-field", default="user_id", help="event field used as key")
    _add_config_flags(produce, worker=False)
    produce.set_defaults(handler=_produce)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except StreamrecError as exc:
        print(f"streamrec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
