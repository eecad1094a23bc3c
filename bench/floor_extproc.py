#!/usr/bin/env python3
"""The floor of the hot path: a do-nothing ext_proc behind pd-extproc's own Envoy.

The Envoy bootstrap is the one `pd-extproc up` renders for the same config (the project's
`render_bootstrap`: filter, routes, clusters, EDS from this process, gRPC health, the P-leg
listener), and the gRPC server has pd-extproc's options. The ext_proc answers each message as
soon as it can and fires the P leg (aiohttp straight to the engine, as pd-extproc's default
P leg) from a request built before the first client came: no parsing, planning, scheduling,
identity check, metrics or logs. Per request it only makes a fresh id (the engines pair P's
push and D by it) and splices it into the pre-built bodies.

Modes (the processing mode of the LLM routes; the rest of the bootstrap is unchanged):

  same     pd-extproc's own (STREAMED_BODY): request headers, the body streamed in full
           duplex (one chunk + an empty end-of-stream chunk from an HTTP/1.1 client), response
           headers; the header answer waits for the whole body (it carries D's content-length,
           as pd-extproc's must). Per request 4 messages in, 3 out.
  fewest   the fewest Envoy allows for reading the body and routing it: request headers
           SKIP, body BUFFERED, everything else SKIP: Envoy sends the whole body in one
           message and one answer routes it and replaces it. 1 in, 1 out: a body needs a
           message to be read and a mutation needs an answer; the observability mode sends
           without waiting but cannot mutate. Envoy applies no header mutation of a body
           answer when the headers were skipped, so the destination goes as dynamic metadata
           and Envoy drops the stale content-length (`floor_bootstrap`). What it gives up: the
           client's headers (x-request-id, traceparent, the forwarded ones, the key, the path)
           and D's status (holding D's 2xx until P settles, the request's outcome, the
           in-flight count at D until the answer ends).

    python bench/floor_extproc.py --config CONFIG.yaml --prefill H:P --decode H:P \
        --identity JSON --prompt JSON --mode same --ready-file F   (bench/targets.running_floor)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from grpc_health.v1 import health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.bootstrap.ext_proc_filter import STREAMED_BODY
from extproc.bootstrap.render import render_bootstrap, render_yaml
from extproc.config import Config, load_config
from extproc.headers import DESTINATION_HEADER
from extproc.membership.eds import EndpointDiscovery, Memberships, pool_cluster_name
from extproc.metrics import Metrics
from extproc.process.envoy_process import EnvoyProcess
from extproc.process.grpc_health import HealthServices
from extproc.process.server import GRPC_OPTIONS
from extproc.protocol.bodies import Spliced
from extproc.request import envoy_msgs
from extproc.roles import Role

FEWEST = {
    "request_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SKIP",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}
MODES = {"same": dict(STREAMED_BODY), "fewest": FEWEST}
_ID = b"@ID@"
_FILTER = "envoy.filters.http.ext_proc"
_LB = "envoy.lb"  # the namespace gateways route by (override_host's metadata source)
_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_CONTINUE = {
    "request_trailers": envoy_msgs.continue_request_trailers(),
    "response_headers": envoy_msgs.continue_response_headers(),
    "response_trailers": envoy_msgs.continue_response_trailers(),
}


class Legs:
    """The pre-built P and D requests; `bodies()` gives one request's pair, with its own id."""

    def __init__(self, prefill: str, decode: str, prompt: dict[str, Any], identity: dict) -> None:
        self.p_url = f"http://{prefill}/v1/completions"
        self.decode = decode
        rid = _ID.decode()
        p = prompt | {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": rid,
            },
        }
        ids = {"remote_request_id": rid, "transfer_id": rid}
        d = prompt | {"kv_transfer_params": identity | ids}
        self._p = orjson.dumps(p).split(_ID)
        self._d = orjson.dumps(d).split(_ID)
        self._ids = itertools.count()
        self.session: aiohttp.ClientSession | None = None

    def bodies(self) -> tuple[str, bytes, bytes]:
        rid = f"floor-{next(self._ids)}"
        raw = rid.encode()
        return rid, raw.join(self._p), raw.join(self._d)

    async def send_p(self, rid: str, body: bytes) -> None:
        assert self.session is not None
        headers = {"content-type": "application/json", "x-request-id": rid}
        async with self.session.post(self.p_url, data=body, headers=headers) as response:
            await response.read()


class FloorProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def Process(self, request_iterator: Any, context: aio.ServicerContext) -> None:
        legs, streamed, p_leg = self.legs, False, None
        try:
            while (message := await context.read()) is not aio.EOF:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    streamed = message.protocol_config.request_body_mode == _FULL_DUPLEX
                    if not streamed:  # buffered: the headers pass, the body answer routes
                        await context.write(envoy_msgs.continue_request_headers())
                elif kind == "request_body":
                    if not message.request_body.end_of_stream:
                        continue  # a streamed chunk: consumed, the answer replaces the body
                    rid, p_body, d_body = legs.bodies()
                    p_leg = asyncio.create_task(legs.send_p(rid, p_body))
                    mutation = envoy_msgs.route_mutation([legs.decode], rid, len(d_body))
                    if streamed:
                        await context.write(envoy_msgs.headers_answer(mutation))
                        for chunk in envoy_msgs.streamed_body_answers(
                            Spliced((d_body,), len(d_body))
                        ):
                            await context.write(chunk)
                    else:
                        answer = _buffered_answer(mutation, d_body)
                        envoy_msgs.with_destination_metadata(answer, [legs.decode], _LB)
                        await context.write(answer)
                elif kind in _CONTINUE:
                    await context.write(_CONTINUE[kind])
            if p_leg is not None:
                await asyncio.wait_for(p_leg, 30)
        finally:
            if p_leg is not None and not p_leg.done():
                p_leg.cancel()


def _buffered_answer(mutation: ep.HeaderMutation, body: bytes) -> ep.ProcessingResponse:
    common = ep.CommonResponse(header_mutation=mutation, body_mutation=ep.BodyMutation(body=body))
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


def floor_bootstrap(cfg: Config, address: str, prefill_listener: str, mode: str) -> dict:
    """pd-extproc's bootstrap for `cfg`, with the LLM routes' processing mode set to `mode`.

    `fewest` also routes as a gateway does: Envoy applies no header mutation of a body answer
    when the request headers were skipped, so the destination goes out as dynamic metadata
    (envoy.lb/x-gateway-destination-endpoint, read by the pools' override_host), and Envoy
    drops the stale content-length of the replaced body (D gets it chunked)."""
    bootstrap = render_bootstrap(cfg, address, prefill_listener)
    resources = bootstrap["static_resources"]
    for listener in resources["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        for route in (r for host in hcm["route_config"]["virtual_hosts"] for r in host["routes"]):
            override = route.get("typed_per_filter_config", {}).get(_FILTER, {}).get("overrides")
            if override is not None:
                override["processing_mode"] = dict(MODES[mode])
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] == _FILTER and mode == "fewest":
                typed = http_filter["typed_config"]
                typed["allow_content_length_header"] = False
                typed["metadata_options"]["receiving_namespaces"]["untyped"].append(_LB)
    if mode == "fewest":
        for cluster in resources["clusters"]:
            for policy in cluster.get("load_balancing_policy", {}).get("policies", []):
                typed = policy["typed_extension_config"]["typed_config"]
                if "override_host_sources" in typed:
                    path = [{"key": DESTINATION_HEADER}]
                    typed["override_host_sources"] = [{"metadata": {"key": _LB, "path": path}}]
    return bootstrap


async def serve(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    legs = Legs(args.prefill, args.decode, orjson.loads(args.prompt), orjson.loads(args.identity))
    memberships = Memberships()
    memberships.publish(pool_cluster_name(Role.PREFILL), [args.prefill])
    memberships.publish(pool_cluster_name(Role.DECODE), [args.decode])
    health = HealthServices(gated=False)
    server = aio.server(options=GRPC_OPTIONS)
    ep_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(legs), server)
    eds = EndpointDiscovery(memberships, Metrics())
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(eds, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    with tempfile.TemporaryDirectory(prefix="floor-extproc-") as tmp:
        run_dir = Path(tmp)
        address = f"unix:{run_dir / 'extproc.sock'}"
        server.add_insecure_port(address)
        await server.start()
        await health.started()
        await health.ready()
        envoy = EnvoyProcess(run_dir / "envoy.yaml", run_dir, "warning", cfg.envoy.concurrency)
        bootstrap = floor_bootstrap(cfg, address, f"unix:{run_dir / 'prefill.sock'}", args.mode)
        envoy.config_path.write_text(render_yaml(bootstrap))
        legs.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
            skip_auto_headers=("User-Agent",),
        )
        try:
            await envoy.start()
            ingress = await envoy.listener_address("ingress")
            ready = {"url": f"http://{ingress}", "envoy_admin": envoy.admin_url}
            args.ready_file.write_bytes(orjson.dumps(ready))
            await stop.wait()
        finally:
            eds.close()
            await envoy.stop()
            await server.stop(1)
            await legs.session.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="pd-extproc's config file")
    parser.add_argument("--prefill", required=True, help="host:port of the prefill engine")
    parser.add_argument("--decode", required=True, help="host:port of the decode engine")
    parser.add_argument("--identity", required=True, help="P's kv_transfer_params for D (JSON)")
    parser.add_argument("--prompt", required=True, help="the request's fields (JSON)")
    parser.add_argument("--mode", choices=sorted(MODES), default="same")
    parser.add_argument("--ready-file", type=Path, required=True)
    return parser.parse_args()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(parse_args()))
