"""`pd-extproc up | serve | epp | render-envoy | demo`: parse, load the config, run one thing.

Errors a user can cause (bad config, port in use, Envoy missing) print one line and exit 2
(config) or 1 (start-up), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.config import SHARED_PREFILL_LISTENER, Config, ConfigError, load_config
from extproc.logs import configure_logging
from extproc.metrics import package_version
from extproc.process.envoy_process import EnvoyError

if TYPE_CHECKING:
    from extproc.process.lifecycle import Service

__all__ = ["main"]

log = logging.getLogger("extproc")


def _parser() -> argparse.ArgumentParser:
    # --log-level is accepted before or after the command; SUPPRESS keeps a subcommand's
    # absent flag from overwriting one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        help="Python log level (default INFO; WARNING for demo)",
    )
    parser = argparse.ArgumentParser(
        prog="pd-extproc",
        parents=[common],
        description="Envoy ext_proc for vLLM prefill/decode disaggregation (parallel NIXL push).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", "-c", required=True, type=Path, help="the YAML config file")
    ready = argparse.ArgumentParser(add_help=False)
    ready.add_argument("--ready-file", type=Path, help="write the bound addresses here as JSON")
    listener = argparse.ArgumentParser(add_help=False)
    listener.add_argument(
        "--prefill-listener",
        default=None,
        help="your Envoy's prefill listener, unix:/path or 127.0.0.1:port (default: "
        f"envoy.prefill_listener from the config, else {SHARED_PREFILL_LISTENER})",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "up", parents=[common, config, ready], help="start Envoy and the ext_proc for a config"
    )
    commands.add_parser(
        "serve",
        parents=[common, config, ready, listener],
        help="run only the ext_proc, for an existing Envoy",
    )
    commands.add_parser(
        "epp",
        parents=[common, config, ready],
        help="run only the ext_proc, as the endpoint picker of a gateway's inference pool",
    )
    render = commands.add_parser(
        "render-envoy", parents=[common, config, listener], help="print the Envoy bootstrap"
    )
    render.add_argument(
        "--extproc-address",
        default=None,
        help="host:port of the ext_proc (default: from the config)",
    )
    render.add_argument(
        "--snippet",
        action="store_true",
        help="print only the pieces to paste into an Envoy you run (its header says where)",
    )
    demo = commands.add_parser(
        "demo", parents=[common], help="2P2D simulated push engines + Envoy + ext_proc"
    )
    demo.add_argument("--once", action="store_true", help="send the demo requests, then exit")
    demo.add_argument("--requests", type=int, default=6)
    demo.add_argument("--port", type=int, default=8000, help="Envoy's port for clients")
    return parser


async def _until_signal(body: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await body(stop)


def _configured_envoy_admin(config: Config) -> str:
    """`serve`: the Envoy is the user's; envoy.admin says where its admin is (as `render-envoy`
    renders it), when it names a port. A wildcard host is reached on loopback."""
    admin = config.envoy.admin
    if admin.port == 0 or admin.host.startswith("unix:"):
        return ""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(admin.host, admin.host)
    return f"http://[{host}]:{admin.port}" if ":" in host else f"http://{host}:{admin.port}"


def _service(args: argparse.Namespace, config: Config) -> Service:
    """What `up`, `serve` or `epp` runs (built inside the event loop that runs it)."""
    from extproc.process.app import Sidecar
    from extproc.process.extproc_service import NO_LISTENER, ExtProcService

    if args.command == "up":
        return Sidecar(config)
    if args.command == "serve":
        listener = config.envoy.shared_prefill_listener(args.prefill_listener)
        service = ExtProcService(config, listener)
        service.server.envoy_admin = _configured_envoy_admin(config)
        return service
    # The endpoint picker: P legs straight to the engines (a gateway's Envoy has no prefill
    # listener), TLS and the protocol's health services.
    if config.extproc.host in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "the endpoint picker listens on %s only: a gateway in another pod cannot "
            "reach it (set extproc.host: 0.0.0.0)",
            config.extproc.host,
        )
    return ExtProcService(config, NO_LISTENER, endpoint_picker=True)


def _render(
    config: Config, extproc_address: str | None, prefill_listener: str, snippet: bool = False
) -> int:
    from extproc.bootstrap.render import (
        render_bootstrap,
        render_snippet,
        render_yaml,
        snippet_header,
    )

    if extproc_address is None and config.extproc.address.endswith(":0"):
        raise ConfigError("extproc.port is 0 (any free port): pass --extproc-address host:port")
    address = extproc_address or config.extproc.address
    side = config.extproc.eds_access_log
    if side is not None and side.address.endswith(":0"):
        raise ConfigError("extproc.eds_access_log.port is 0 (any free port): give its port")
    feeds = None if side is None else side.address
    if snippet:  # the pieces for an Envoy the user already runs
        pieces = render_snippet(config, address, prefill_listener, feeds)
        sys.stdout.write(snippet_header(config) + render_yaml(pieces))
        return 0
    sys.stdout.write(render_yaml(render_bootstrap(config, address, prefill_listener, feeds)))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from extproc.demo import run_demo

        return asyncio.run(
            _until_signal(
                lambda stop: run_demo(stop, once=args.once, requests=args.requests, port=args.port)
            )
        )
    config = load_config(args.config)
    configure_logging(args.log_level or "INFO", config.log.format)
    if args.command == "render-envoy":
        listener = config.envoy.shared_prefill_listener(args.prefill_listener)
        return _render(config, args.extproc_address, listener, args.snippet)
    from extproc.process.lifecycle import run

    return asyncio.run(
        _until_signal(lambda stop: run(_service(args, config), args.config, args.ready_file, stop))
    )


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.log_level = getattr(args, "log_level", None)
    level = args.log_level or ("WARNING" if args.command == "demo" else "INFO")
    if level.upper() not in logging.getLevelNamesMapping():  # also WARN, FATAL, NOTSET
        print(
            f"pd-extproc: --log-level {level}: one of {', '.join(_LOG_LEVELS)} (any case)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return _run(args)
    except ConfigError as error:
        print(f"pd-extproc: invalid configuration:\n{error}", file=sys.stderr)
        return 2
    except (EnvoyError, OSError) as error:
        print(f"pd-extproc: cannot start: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
