"""The ``streamrec`` command line.

Each subcommand is one handler taking the parsed namespace and returning an exit status.
Exit statuses: 0 success, 1 failure (a user mistake or an unreachable dependency: one line
on stderr that names the value, never a traceback), 2 usage errors (argparse).

Start-up is kept cheap: this module imports neither torch nor aiokafka, and a
subcommand's arguments are added only when that subcommand is the one being parsed (some
take their defaults from torch-importing modules), so ``streamrec --help`` and the
Kafka-only commands do not pay for torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from streamrec import __version__
from streamrec.errors import ConfigError, StreamrecError
from streamrec.tools.config_flags import (
    CLIENT_FLAGS,
    WORKER_FLAGS,
    DeprecatedAlias,
    HelpFormatter,
    add_config_flags,
    check_device,
    config_overrides,
    effective_config,
)
from streamrec.tools.supervisor import add_supervisor_arguments, run_supervised, supervising
from streamrec.worker.config import DEVICES, HttpConfig, config_fields

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
    "offline-eval": "bench.offline_eval",
}

__all__ = ["build_parser", "config_overrides", "effective_config", "main", "render_toml"]


# ---------------------------------------------------------------------- device flags


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """``--device`` of the offline commands, with the worker's values and default."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="{" + ",".join(DEVICES) + "}",
        help="auto = CUDA if available, else CPU",
    )


def resolve_device(value: str, what: str = "--device") -> str:
    """``auto`` -> what this machine has; ``cuda`` without CUDA is a one-line error."""
    import torch

    check_device(value, what)
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cuda" and not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else "sees no GPU"
        raise ConfigError(f"{what} {value!r}: no CUDA device (torch {torch.__version__} {build})")
    return value


def _on_device(handler: Handler) -> Handler:
    """The handler with ``args.device`` checked and resolved first."""

    def run(args: argparse.Namespace) -> int:
        args.device = resolve_device(args.device)
        return handler(args)

    return run


# ---------------------------------------------------------------------- handlers


def _check_port_free(http: HttpConfig) -> None:
    """A taken HTTP port is the user's mistake: say so before anything starts."""
    from streamrec.tools.devbroker import free_port

    if http.port == 0:
        return
    try:
        free_port(http.host, http.port)
    except StreamrecError:
        raise ConfigError(
            f"http.port = {http.port}: {http.host}:{http.port} is already in use "
            "(pick another with --http-port, or 0 for any free port)"
        ) from None


def _run(args: argparse.Namespace) -> int:
    """The worker until SIGTERM/SIGINT (then drain, flush, commit, exit 0); with ``--gpus``
    (or ``--cpu-children``) a supervisor of one such worker per GPU."""
    if supervising(args):
        return run_supervised(effective_config(args), args)
    import signal

    import uvloop

    from streamrec.worker.logging_setup import configure_logging

    config = effective_config(args)
    configure_logging(config.log)
    _check_port_free(config.http)  # before torch is even imported

    from streamrec.worker.app import App

    async def serve() -> int:
        app = App(config, freeze_heap=True)  # this process serves one worker
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, app.stop)
        return await app.run()

    try:
        return uvloop.run(serve())
    except OSError as exc:  # e.g. the HTTP port was taken between the check and the bind
        raise ConfigError(f"http {config.http.host}:{config.http.port}: {exc.strerror}") from None


def _demo(args: argparse.Namespace) -> int:
    from streamrec.tools.demo import run_demo_command

    return run_demo_command(args)


def _broker(args: argparse.Namespace) -> int:
    from streamrec.tools.broker_command import run_broker

    return run_broker(effective_config(args), args.partitions)


def _consume(args: argparse.Namespace) -> int:
    from streamrec.tools.consume_command import run_consume

    config = effective_config(args)
    return run_consume(args, config.kafka, config.topics.output)


def _probe(args: argparse.Namespace) -> int:
    from streamrec.tools.probe_command import run_probe

    return run_probe(args)


def _export(args: argparse.Namespace) -> int:
    """``streamrec export``: flags beat the worker config, so the package the worker
    looks for (model dir, cache dir, device, retrieve k) is the one that gets built."""
    from streamrec.tools.export_command import run_export

    config = effective_config(args)
    return run_export(args, config, resolve_device(config.model.device, "model.device ="))


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
                skip_invalid=args.skip_invalid,
                dry_run=args.dry_run,
            )
        )
    finally:
        if args.file is not None:
            stream.close()
    for error in stats.errors:
        print(f"streamrec produce: {error}", file=sys.stderr)
    what = f"to {args.topic!r} ({kind.value}, {fmt.name.lower()})"
    counts = f"{stats.invalid} invalid, {stats.blank} blank"
    if args.dry_run:
        summary = f"dry run: {stats.valid} valid lines would be sent {what}, {counts}"
    elif stats.invalid and not args.skip_invalid:
        summary = (
            f"sent 0 {what}: {counts}; nothing was sent (all or nothing: fix the lines, "
            "or pass --skip-invalid to send the valid ones)"
        )
    else:
        summary = f"sent {stats.sent} {what}, {counts}"
    print(f"streamrec produce: {summary}", file=sys.stderr)
    return EXIT_FAILURE if stats.invalid and not args.skip_invalid else EXIT_OK


def _training_data(args: argparse.Namespace) -> Any:
    from streamrec.offline.datasets import SyntheticSpec, read_movielens, synthetic_log

    if args.events is not None:
        return read_movielens(args.events)
    return synthetic_log(SyntheticSpec(seed=args.seed))


def _train(args: argparse.Namespace) -> int:
    from streamrec.offline.training import TrainConfig, train

    config = TrainConfig(
        epochs=args.epochs,
        seed=args.seed,
        device=args.device,
        max_seq_len=args.max_seq_len,
        seq_len=min(args.max_seq_len, TrainConfig.seq_len),
        patience=args.patience,
        threads=args.threads,
    )
    if args.draft_of is not None:
        from streamrec.offline.distillation import DraftConfig, train_draft

        draft = DraftConfig(
            num_layers=args.draft_layers,
            rollout_k=args.rollout_k,
            rollout_exclude_recent=args.rollout_exclude_recent,
        )
        result = train_draft(_training_data(args), args.draft_of, args.out, config, draft)
    else:
        result = train(_training_data(args), args.out, config)
    print(
        f"streamrec train: wrote {result.model_dir} (model_version {result.model_version}, "
        f"{result.steps} steps, loss {result.final_loss:.4f}, {result.seconds:.1f} s"
        + (f", kept epoch {result.best_epoch} of {result.epochs})" if result.best_epoch else ")")
    )
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from streamrec.tools.eval_command import run_eval

    return run_eval(args, _training_data(args))


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--synthetic", action="store_true", help="synthetic data (the default)")
    data.add_argument(
        "--ratings", "--events", dest="events", type=Path, metavar="RATINGS_CSV",
        help="MovieLens-format ratings.csv (userId,movieId,rating,timestamp)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    add_device_flag(parser)


# ---------------------------------------------------------------------- subcommand arguments


def _build_run(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, WORKER_FLAGS)
    add_supervisor_arguments(parser)
    parser.set_defaults(handler=_run)


def _build_demo(parser: argparse.ArgumentParser) -> None:
    from streamrec.tools.demo_data import DEFAULT_MOVIELENS, DEMO_DEFAULTS, DemoConfig

    parser.add_argument(
        "--ratings",
        type=Path,
        metavar="RATINGS_CSV",
        help=f"MovieLens-format ratings.csv; movies.csv beside it gives titles (default: "
        f"{DEFAULT_MOVIELENS} if present, else synthetic data)",
    )
    parser.add_argument("--events", dest="ratings", type=Path, action=DeprecatedAlias,
                        replacement="--ratings")  # fmt: skip
    parser.add_argument(
        "--synthetic", action="store_true", help="synthetic data even if MovieLens is present"
    )
    d = DemoConfig()
    parser.add_argument(
        "--num-events", type=int, default=d.paced_events, help="events replayed at --rate"
    )
    parser.add_argument(
        "--unpaced-events", type=int, default=d.unpaced_events, help="then replayed unpaced"
    )
    parser.add_argument("--rate", type=float, default=d.rate, help="paced replay, events/s")
    parser.add_argument("--users", type=int, default=d.users, help="users replayed")
    parser.add_argument("--partitions", type=int, default=d.partitions, help="per topic")
    parser.add_argument(
        "--watch", type=int, default=d.watch_users, help="users whose updates are printed"
    )
    parser.add_argument("--retrain", action="store_true", help="ignore the cached demo model")
    shown = {
        "model.model_dir": "default: the demo model, trained once into .streamrec-cache/demo/",
        "log.level": f"demo default: {DEMO_DEFAULTS['log.level']}",
    }
    add_config_flags(parser, ("--model", "--device", "--backend", "--log-level"), shown)
    parser.set_defaults(handler=_demo)


def _build_train(parser: argparse.ArgumentParser) -> None:
    from streamrec.offline.distillation import DraftConfig
    from streamrec.offline.training import TrainConfig
    from streamrec.pipeline.scoring_config import ScoringConfig

    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="model directory")
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs, help="passes")
    parser.add_argument(
        "--max-seq-len", type=int, default=TrainConfig.max_seq_len, help="history window"
    )
    parser.add_argument(
        "--patience", type=int, default=TrainConfig.patience,
        help="stop after this many epochs without a better validation NDCG@10 (0: never)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=TrainConfig.threads, help="torch CPU threads (0: torch's)"
    )
    parser.add_argument(
        "--draft-of", type=Path, metavar="MODEL_DIR",
        help="distill a draft of MODEL_DIR for speculative generation (same vocabulary)",
    )  # fmt: skip
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of the draft")
    parser.add_argument(
        "--rollout-k", type=int, default=DraftConfig.rollout_k, metavar="K",
        help="then train the draft on the target's own K-item continuations (0: data only)",
    )  # fmt: skip
    parser.add_argument(
        "--rollout-exclude-recent", type=int, default=ScoringConfig.exclude_recent, metavar="N",
        help="in those continuations the target never repeats a user's N newest items: the "
        "worker's scoring.exclude_recent, which generation excludes too",
    )  # fmt: skip
    _add_data_flags(parser)
    parser.set_defaults(handler=_on_device(_train))


def _build_eval(parser: argparse.ArgumentParser) -> None:
    from streamrec.tools.eval_command import add_eval_arguments

    add_eval_arguments(parser)
    parser.add_argument("--model-dir", dest="model", type=Path, action=DeprecatedAlias,
                        replacement="--model")  # fmt: skip
    _add_data_flags(parser)
    parser.set_defaults(handler=_on_device(_eval))


def _build_export(parser: argparse.ArgumentParser) -> None:
    from streamrec.tools.export_command import add_export_arguments

    add_config_flags(parser, ("--model", "--cache-dir", "--device", *CLIENT_FLAGS[1:]))
    parser.add_argument("--model-dir", dest="model", action=DeprecatedAlias,
                        replacement="--model")  # fmt: skip
    add_export_arguments(parser)
    parser.set_defaults(handler=_export)


def _build_bench(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="its own flags")
    parser.set_defaults(handler=_bench)


def _build_config(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="print the effective configuration", formatter_class=HelpFormatter
    )
    add_config_flags(show, WORKER_FLAGS)
    show.add_argument("--format", choices=("toml", "json"), default="toml", help="output")
    show.add_argument("--show-secrets", action="store_true", help="do not mask passwords")
    show.set_defaults(handler=_config_show)


def _build_produce(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", required=True, help="input topic to send to")
    parser.add_argument("--file", type=Path, help="JSON-lines file (default: stdin)")
    parser.add_argument(
        "--format", choices=("msgpack", "json"), default="msgpack", help="wire format"
    )
    parser.add_argument(
        "--kind",
        choices=("playback", "interaction"),
        help="event schema (default: by topic name from the config)",
    )
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="send the valid lines even if some are invalid (streams lines as they arrive)",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate only, send nothing")
    add_config_flags(parser, CLIENT_FLAGS)
    parser.set_defaults(handler=_produce)


def _build_broker(parser: argparse.ArgumentParser) -> None:
    from streamrec.tools.broker_command import add_broker_arguments

    add_broker_arguments(parser)
    add_config_flags(parser, ("--bootstrap-servers",))
    parser.set_defaults(handler=_broker)


def _build_consume(parser: argparse.ArgumentParser) -> None:
    from streamrec.tools.consume_command import add_consume_arguments

    add_consume_arguments(parser)
    add_config_flags(parser, CLIENT_FLAGS)
    parser.set_defaults(handler=_consume)


def _build_probe(parser: argparse.ArgumentParser) -> None:
    from streamrec.tools.probe_command import add_probe_arguments

    add_probe_arguments(parser)
    parser.set_defaults(handler=_probe)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    build: Callable[[argparse.ArgumentParser], None]


COMMANDS: Final = (
    Command("run", "run the worker against a Kafka cluster", _build_run),
    Command(
        "demo", "dev broker + small model + replayed events, with a closing table", _build_demo
    ),
    Command(
        "broker", "a local dev broker with the configured topics (Ctrl-C stops)", _build_broker
    ),
    Command("produce", "send JSON-lines events to a topic", _build_produce),
    Command("consume", "print a topic's records as JSON lines", _build_consume),
    Command("train", "train a model directory", _build_train),
    Command("eval", "evaluate a model offline, or HSTU vs baselines over seeds", _build_eval),
    Command("export", "compile a model to an AOTInductor package", _build_export),
    Command("bench", "run a benchmark of bench/ (source checkout)", _build_bench),
    Command("config", "inspect the configuration", _build_config),
    Command(
        "probe", "exit 0 only if every worker port answers 200 (a pod's exec probe)", _build_probe
    ),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``command`` given) one whose other subcommands have no
    arguments yet: what ``main`` uses so that parsing never imports more than needed."""
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description="Streaming generative recommendations: Kafka events -> HSTU -> top-K.",
    )
    parser.add_argument("--version", action="version", version=f"streamrec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        child = sub.add_parser(
            cmd.name, help=cmd.help, description=cmd.help, formatter_class=HelpFormatter
        )
        if command is None or command == cmd.name:
            cmd.build(child)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: the top level takes no option with a value."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamrec`` console script; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(args_in) or "")  # "": no subcommand's arguments
    args = parser.parse_args(args_in)
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
