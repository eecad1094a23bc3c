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

import orjson

from extproc.config import SHARED_PREFILL_LISTENER, Config, ConfigError, load_config
from extproc.logs import configure_logging
from extproc.metrics import package_version
from extproc.process.envoy_process import EnvoyError

if TYPE_CHECKING:
    from extproc.process.server import ExtProcServer

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


async def _up(
    config: Config, config_path: Path, ready_file: Path | None, stop: asyncio.Event
) -> int:
    from extproc.process.app import Sidecar
    from extproc.reload import HangupReloads

    sidecar = Sidecar(config)
    addresses = await sidecar.start()
    reloads = HangupReloads(lambda: sidecar.reload(config_path))
    _write_ready(ready_file, addresses.to_json())
    print(
        f"pd-extproc is up: {addresses.url}/v1/completions "
        f"(metrics {addresses.metrics}/metrics, Envoy admin {addresses.envoy_admin})",
        flush=True,
    )
    envoy_exit = asyncio.create_task(sidecar.wait_envoy_exit())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({envoy_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    code = 0
    if envoy_exit.done():
        code = 1
        log.error("Envoy exited (%s); see %s", envoy_exit.result(), sidecar.envoy.log_path)
    envoy_exit.cancel()
    reloads.close()
    if code == 0:
        await sidecar.drain()
    await sidecar.stop()
    return code


def _write_ready(path: Path | None, payload: bytes) -> None:
    """Atomically, so that a watcher never reads half a file."""
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.rename(path)


async def _start_or_stop(server: ExtProcServer) -> None:
    """Bind the server's ports; if one cannot be bound, release what was (one line, no leak)."""
    try:
        await server.start()
    except BaseException:
        await server.stop(0)
        raise


async def _serve(
    config: Config,
    config_path: Path,
    prefill_listener: str,
    ready_file: Path | None,
    stop: asyncio.Event,
) -> int:
    from extproc.process.server import ExtProcServer
    from extproc.reload import HangupReloads, reload_runtime
    from extproc.wiring import Runtime

    runtime = Runtime(config, prefill_listener)
    await runtime.discover()  # the first answer already knows every pool member
    server = ExtProcServer(runtime)
    server.envoy_admin = _configured_envoy_admin(config)
    await _start_or_stop(server)
    reloads = HangupReloads(lambda: reload_runtime(runtime, config_path))
    try:
        await runtime.start()
        await server.ready()
        metrics = f"http://{config.metrics.host}:{server.metrics_port}"
        _write_ready(ready_file, orjson.dumps({"extproc": server.address, "metrics": metrics}))
        print(f"pd-extproc ext_proc on {server.address}, metrics {metrics}/metrics", flush=True)
        await stop.wait()
    finally:
        reloads.close()
        # Drain: health turns NOT_SERVING, new streams are refused (Envoy answers them with
        # its JSON 503), streams in flight finish for up to timeouts.drain_s.
        log.info("draining %d open requests", runtime.active_streams)
        await server.stop(runtime.config.timeouts.drain_s)
    return 0


def _configured_envoy_admin(config: Config) -> str:
    """`serve`: the Envoy is the user's; envoy.admin says where its admin is (as `render-envoy`
    renders it), when it names a port. A wildcard host is reached on loopback."""
    admin = config.envoy.admin
    if admin.port == 0 or admin.host.startswith("unix:"):
        return ""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(admin.host, admin.host)
    return f"http://[{host}]:{admin.port}" if ":" in host else f"http://{host}:{admin.port}"


NO_LISTENER = "unix:/nonexistent"  # an endpoint picker's P legs go straight to the engines


async def _epp(config: Config, config_path: Path, ready_file: Path | None,
               stop: asyncio.Event) -> int:  # fmt: skip
    """The endpoint picker: like `serve`, with P legs straight to the engines (a gateway's
    Envoy has no prefill listener), TLS and the protocol's health services."""
    from extproc.process.server import ExtProcServer
    from extproc.reload import HangupReloads, reload_runtime
    from extproc.wiring import Runtime

    if config.extproc.host in ("127.0.0.1", "::1", "localhost"):
        log.warning("the endpoint picker listens on %s only: a gateway in another pod cannot "
                    "reach it (set extproc.host: 0.0.0.0)", config.extproc.host)  # fmt: skip
    runtime = Runtime(config, NO_LISTENER, endpoint_picker=True)
    await runtime.discover()
    server = ExtProcServer(runtime, endpoint_picker=True)
    await _start_or_stop(server)
    reloads = HangupReloads(lambda: reload_runtime(runtime, config_path))
    try:
        await runtime.start()
        await server.ready()
        metrics = f"http://{config.metrics.host}:{server.metrics_port}"
        ready = {"extproc": server.address, "metrics": metrics, "health_port": server.health_port}
        _write_ready(ready_file, orjson.dumps(ready))
        print(f"pd-extproc endpoint picker on {server.address}, gRPC health on port "
              f"{server.health_port or 'of the ext_proc'}, metrics {metrics}/metrics",
              flush=True)  # fmt: skip
        await stop.wait()
    finally:
        reloads.close()
        log.info("draining %d open requests", runtime.active_streams)
        await server.stop(runtime.config.timeouts.drain_s)
    return 0


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
    if snippet:  # the pieces for an Envoy the user already runs
        pieces = render_snippet(config, address, prefill_listener)
        sys.stdout.write(snippet_header(config) + render_yaml(pieces))
        return 0
    sys.stdout.write(render_yaml(render_bootstrap(config, address, prefill_listener)))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from extproc.demo import INSTALL_SIM, missing_sim_modules, run_demo

        if missing := missing_sim_modules():
            print(f"pd-extproc demo: the simulated engines need {', '.join(missing)}, "
                  f"from the simulator's extra: {INSTALL_SIM}", file=sys.stderr)  # fmt: skip
            return 1
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
    if args.command == "epp":
        return asyncio.run(
            _until_signal(lambda stop: _epp(config, args.config, args.ready_file, stop))
        )
    if args.command == "serve":
        listener = config.envoy.shared_prefill_listener(args.prefill_listener)
        return asyncio.run(
            _until_signal(lambda stop: _serve(config, args.config, listener, args.ready_file, stop))
        )
    return asyncio.run(_until_signal(lambda stop: _up(config, args.config, args.ready_file, stop)))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.log_level = getattr(args, "log_level", None)
    level = args.log_level or ("WARNING" if args.command == "demo" else "INFO")
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
