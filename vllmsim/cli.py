"""`vllmsim`: start one simulated vLLM 0.33 engine.

Flags follow `vllm serve` where they mean the same thing (--host, --port, --model,
--served-model-name, --kv-transfer-config, --tokenizer, --api-key, --block-size,
--enable-prefix-caching / --no-enable-prefix-caching, --enable-prompt-tokens-details,
--kv-events-config, --enable-lora / --lora-modules; VLLM_API_KEY, VLLM_SERVER_DEV_MODE
(POST /reset_prefix_cache), VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT).
Cost-model and fault flags are the simulator's own.

Deviation from vLLM, by design: a push decode request missing a required
kv_transfer_params key (remote_engine_id, remote_host, remote_port, tp_size,
remote_request_id) makes real vLLM's EngineCore die with a KeyError; the simulator
logs an error and answers that request with HTTP 500 instead.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from vllmsim.config import (
    BLOCK_SIZE,
    PULL_CONNECTORS,
    PUSH_CONNECTORS,
    ROLES,
    CacheConfig,
    CostModel,
    Faults,
    KVTransferConfig,
    SimConfig,
)
from vllmsim.kv_events import KVEventsSocketError
from vllmsim.kv_events import parse_config as parse_kv_events_config
from vllmsim.nixl.side_channel import SideChannelBindError
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES

log = logging.getLogger("vllmsim")


class ConfigError(Exception):
    """A bad flag or bad --kv-transfer-config: one line on stderr, exit 2."""


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kv-transfer-config is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("--kv-transfer-config must be a JSON object")
    connector = raw.get("kv_connector")
    if connector not in PUSH_CONNECTORS | PULL_CONNECTORS:
        known = ", ".join(sorted(PUSH_CONNECTORS | PULL_CONNECTORS))
        raise ConfigError(f"kv_connector {connector!r} is not supported (use one of {known})")
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ConfigError(f"kv_role is required once kv_connector is set: one of {sorted(ROLES)}")
    if role == "kv_both":
        log.warning("kv_role 'kv_both' is deprecated for NIXL connectors")
    extra = raw.get("kv_connector_extra_config") or {}
    try:
        lease = float(extra.get("kv_lease_duration", 30))
    except (TypeError, ValueError) as exc:
        raise ConfigError("kv_connector_extra_config.kv_lease_duration must be a number") from exc
    policy = raw.get("kv_load_failure_policy", "fail")
    if policy not in ("fail", "recompute"):
        raise ConfigError("kv_load_failure_policy must be 'fail' or 'recompute'")
    engine_id = raw.get("engine_id")
    return KVTransferConfig(connector, role, str(engine_id) if engine_id else None, lease, policy)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllmsim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model_tag", nargs="?", help="model, as in `vllm serve MODEL`")
    p.add_argument("--model", help="model name (default: sim-model)")
    p.add_argument("--served-model-name", nargs="+", help="names the API accepts")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 = ephemeral")
    p.add_argument("--kv-transfer-config", help="JSON, as for vllm serve")
    p.add_argument("--tokenizer", help="local HF tokenizer folder, for exact token counts")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        help="LoRA adapters served under their own model names: name=path, or JSON with "
        '"name" and "path" (no weights are read; the name keys the prefix cache)',
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=BLOCK_SIZE,
        help=f"tokens per KV block (default {BLOCK_SIZE}, as vLLM on GPUs)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep and reuse full blocks (default on, as vLLM)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument(
        "--pre-0-28",
        action="store_true",
        help="P's kv_transfer_params leave out transfer_mode, as vLLM before 0.28 (pull only)",
    )
    p.add_argument("--kv-events-config", help="JSON, as for vllm serve (ZMQ KV cache events)")
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine ranks behind this one API server, each with its own NIXL engine id "
        "(<engine_id>_dp<rank>) and side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT + rank); "
        "the X-data-parallel-rank header pins a request to one",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (one of these keys) on the API; "
        "default: $VLLM_API_KEY",
    )
    p.add_argument(
        "--port-file", help="write {port, side_channel_port, engine_id, pid, ranks} here"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    cost = p.add_argument_group(
        "cost model (default profile: gpu-8b, an 8B-class model on one GPU, fitted to "
        "vllm-project/router PR #187)"
    )
    cost.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        help="named cost model (vllmsim/profiles.py); the flags below override it",
    )
    for f in dataclasses.fields(CostModel):
        flag = "--" + f.name.replace("_", "-")
        cost.add_argument(
            flag,
            type=type(f.default),
            default=None,
            dest=f.name,
            help=f"gpu-8b: {getattr(PROFILES[DEFAULT_PROFILE], f.name)}, "
            f"cpu-tiny: {getattr(PROFILES['cpu-tiny'], f.name)}",
        )
    faults = p.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    faults.add_argument("--fail-next", type=int, default=0, help="fail the next N requests")
    faults.add_argument("--fail-status", type=int, default=500, help="status for --fail-next")
    faults.add_argument("--hang-next", type=int, default=0, help="accept N requests, never answer")
    faults.add_argument("--latency-ms", type=float, default=0.0, help="delay before each answer")
    faults.add_argument("--drop-registrations", action="store_true", help="P ignores PUSH_REG")
    faults.add_argument(
        "--kv-block-offset",
        type=int,
        default=0,
        help="KV this engine sends goes from/to block ids shifted by N",
    )
    faults.add_argument(
        "--kv-truncate-blocks",
        type=int,
        default=0,
        help="KV transfers this engine serves leave out their last N blocks",
    )
    return p


def config_from_args(args: argparse.Namespace, env: dict[str, str]) -> SimConfig:
    names = tuple(args.served_model_name or [args.model or args.model_tag or "sim-model"])
    kv = parse_kv_transfer_config(args.kv_transfer_config) if args.kv_transfer_config else None
    if args.pre_0_28:
        if kv is None or kv.transfer_mode != "pull":
            raise ConfigError("--pre-0-28 needs a pull connector: vLLM before 0.28 only pulls")
        kv = dataclasses.replace(kv, names_transfer_mode=False)
    try:
        side_port = int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    except ValueError as exc:
        raise ConfigError("VLLM_NIXL_SIDE_CHANNEL_PORT must be an integer") from exc
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(CostModel)
        if getattr(args, f.name) is not None
    }
    cost = dataclasses.replace(PROFILES[args.profile], **given)
    if cost.max_num_batched_tokens < 1 or cost.num_gpu_blocks < 1 or cost.kv_bandwidth_gbps <= 0:
        raise ConfigError("cost model values must be positive")
    faults = Faults(
        args.fail_next,
        args.fail_status,
        args.hang_next,
        args.latency_ms,
        args.drop_registrations,
        kv_block_offset=args.kv_block_offset,
        kv_truncate_blocks=args.kv_truncate_blocks,
    )
    if args.tokenizer and not Path(args.tokenizer).exists():
        raise ConfigError(f"--tokenizer {args.tokenizer}: no such file or directory")
    tokenizer = args.tokenizer or _model_folder_tokenizer(args.model or args.model_tag)
    keys = tuple(k for k in (args.api_key or [env.get("VLLM_API_KEY", "")]) if k)
    if args.block_size < 1:
        raise ConfigError(f"--block-size must be a positive integer, got {args.block_size}")
    if not 1 <= args.data_parallel_size <= 64:
        raise ConfigError(f"--data-parallel-size must be 1 to 64, got {args.data_parallel_size}")
    events = None
    if args.kv_events_config:
        try:
            events = parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    return SimConfig(
        args.host,
        args.port,
        names,
        kv,
        env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        side_port,
        tokenizer,
        args.port_file,
        cost,
        faults,
        keys,
        CacheConfig(args.block_size, args.enable_prefix_caching),
        events,
        args.enable_prompt_tokens_details,
        args.data_parallel_size,
        env.get("VLLM_SERVER_DEV_MODE") == "1",
        lora_modules=_lora_names(args.lora_modules, args.enable_lora, names),
    )


def _lora_names(modules: list[str], enabled: bool, served: tuple[str, ...]) -> tuple[str, ...]:
    """The adapters' names, in the order given (vLLM numbers them from 1 in that order)."""
    if modules and not enabled:
        raise ConfigError("--lora-modules needs --enable-lora")
    names: list[str] = []
    for module in modules:
        try:
            parsed = json.loads(module) if module.lstrip().startswith("{") else None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules {module}: not valid JSON: {exc}") from exc
        name = parsed.get("name") if isinstance(parsed, dict) else module.partition("=")[0]
        if not isinstance(name, str) or not name or (parsed is None and "=" not in module):
            raise ConfigError(f"--lora-modules {module}: expected name=path or JSON with a name")
        if name in served or name in names:
            raise ConfigError(f"--lora-modules: the name {name} is already served")
        names.append(name)
    return tuple(names)


def _model_folder_tokenizer(model: str | None) -> str | None:
    """As vLLM: without --tokenizer, a local model folder's own tokenizer."""
    if model and (Path(model) / "tokenizer.json").is_file():
        return model
    return None


def write_port_file(path: str, info: dict[str, Any]) -> None:
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # atomic: readers never see a half-written file


async def serve(cfg: SimConfig) -> None:
    from vllmsim.app import build_app
    from vllmsim.server import SimServer

    sim = SimServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await sim.start(build_app(sim))
    try:
        gen = sim.current
        info = {
            "port": sim.http_port,
            "side_channel_port": sim.side.port,
            "engine_id": gen.engine_id,
            "pid": os.getpid(),
            "ranks": sim.rank_views(),
            **sim.kv_events_endpoints(),
        }
        if cfg.port_file:
            write_port_file(cfg.port_file, info)
        kv = cfg.kv
        for rank in sim.ranks:
            log.info(
                "vllmsim ready on http://%s:%d side channel %s:%d engine_id %s mode %s",
                cfg.host,
                sim.http_port,
                cfg.side_channel_host,
                rank.side.port,
                rank.current.engine_id,
                kv.transfer_mode if kv else "aggregated",
            )
        await stop.wait()
    finally:
        await sim.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = config_from_args(args, dict(os.environ))
        asyncio.run(serve(cfg))
    except ConfigError as exc:
        print(f"vllmsim: error: {exc}", file=sys.stderr)
        return 2
    except SideChannelBindError as exc:  # a second engine on this host, same default port
        print(
            f"vllmsim: error: the NIXL side channel cannot listen on {exc.host}:{exc.port} "
            f"({exc.strerror}): give each engine on one host its own "
            "VLLM_NIXL_SIDE_CHANNEL_PORT (0: any free port)",
            file=sys.stderr,
        )
        return 1
    except KVEventsSocketError as exc:
        print(f"vllmsim: error: {exc} (fix --kv-events-config)", file=sys.stderr)
        return 1
    except OSError as exc:  # port in use, bad host, ...
        print(f"vllmsim: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
