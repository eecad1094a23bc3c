"""The sidecar's one input: a YAML file validated by pydantic.

`load_config` turns a file into a `Config` or raises `ConfigError`, whose message has one line
per problem ("prefill.endpoints.0.address: not a host:port (got 'x')"), so a user sees every
mistake at once and never a traceback.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import typing
import urllib.parse
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from extproc.durations import DAY, INTERVAL, seconds
from extproc.headers import (
    DESTINATION_HEADER,
    ENGINE_PRIORITY_HEADER,
    LOCAL_REPLY_HEADER,
    RANK_HEADER,
)
from extproc.policies import POLICIES, NoOptions, option_keys, parse_options
from extproc.roles import Role

log = logging.getLogger(__name__)

__all__ = [
    "Config",
    "ConfigError",
    "DispatchMode",
    "EndpointConfig",
    "Role",
    "load_config",
    "parse_config",
]


class ConfigError(Exception):
    """The configuration is unusable; `str()` is one line per problem."""


class DispatchMode(StrEnum):
    """How the two legs of a request are sent (see `extproc.request.plan`)."""

    AUTO = "auto"  # learn transfer_mode from P: push → parallel, pull → serial
    PUSH = "push"  # parallel whenever P's identity is known
    PULL = "pull"  # always serial, P's params forwarded verbatim
    SERIAL_PUSH = "serial_push"  # push engines, serial dispatch (the PR #187 baseline)

    @classmethod
    def _missing_(cls, value: object) -> DispatchMode | None:
        # Config values are snake_case; "serial-push" was the one spelt with a hyphen.
        if value == "serial-push":
            log.warning("dispatch mode 'serial-push' is deprecated: write 'serial_push'")
            return cls.SERIAL_PUSH
        return None


def parse_host_port(value: str) -> tuple[str, int]:
    """'10.0.0.1:8000' or '[::1]:8000' → (host, port); raises ValueError with a clear text."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"not a host:port (got {value!r})")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range 1-65535 (got {port})")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not host.replace("-", "").replace(".", "").isalnum():
            raise ValueError(f"not a host name or IP address (got {host!r})") from None
    return host, port


def _leaf_types(annotation: Any) -> set[Any]:
    """The types an annotation admits, through Annotated, unions and Optional."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return {type(arg) for arg in args}
    if not args:
        return {annotation}
    if typing.get_origin(annotation) is Annotated:
        return _leaf_types(args[0])
    return {leaf for arg in args for leaf in _leaf_types(arg)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads `true` as 1 for a number; a number's key given a bool is a mistake."""
        if isinstance(value, bool) and info.field_name is not None:
            leaves = _leaf_types(cls.model_fields[info.field_name].annotation)
            if bool not in leaves and leaves & {int, float}:
                raise ValueError(f"a number, not {str(value).lower()}")
        return value


def _off_as_written(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` (also `no`, `false`) as false: for a field where "off" is
    a value, that is what the user wrote."""
    return "off" if value is False else value


OffAsWritten = BeforeValidator(_off_as_written)


MAX_DATA_PARALLEL = 256  # ranks behind one port; far beyond any deployment
MAX_ENVOY_CONCURRENCY = 1024  # Envoy worker threads; beyond the cores of any host
# Bounds far beyond any useful value, so that a typo (1e100) is refused rather than obeyed.
_COUNT_BOUND = 1000  # consecutive checks, identity changes
_TOKEN_BOUND = 100_000_000  # a prompt's or a step's tokens
_IN_FLIGHT_BOUND = 10_000_000  # requests at once


class EndpointKvEvents(_Strict):
    """One engine's own KV event sockets, where they differ from its pool's `kv_events`: other
    ports on its host, or whole ZMQ addresses (tcp://host:port, ipc:///path)."""

    port: int | None = Field(default=None, gt=0, lt=65536)
    replay_port: int | None = Field(default=None, gt=0, lt=65536)
    endpoint: str | None = None
    replay_endpoint: str | None = None

    @model_validator(mode="after")
    def _one_way(self) -> EndpointKvEvents:
        if (self.port is None) == (self.endpoint is None):
            raise ValueError("give port (and replay_port) or endpoint (and replay_endpoint)")
        if self.port is not None and self.replay_endpoint is not None:
            raise ValueError("with port, the replay socket is replay_port")
        if self.endpoint is not None and self.replay_port is not None:
            raise ValueError("with endpoint, the replay socket is replay_endpoint")
        for value in (self.endpoint, self.replay_endpoint):
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"a ZMQ address: tcp://host:port or ipc:///path (got {value!r})")
        return self


class EndpointConfig(_Strict):
    """One vLLM server. `address` is what Envoy connects to and what routing headers name."""

    address: str
    mode: DispatchMode | None = None  # prefill only: overrides dispatch.mode for this endpoint
    # Its own KV event sockets, for engines that share a host (its pool's kv_events must be set).
    kv_events: EndpointKvEvents | None = None
    # vLLM's --data-parallel-size behind this one port (null: its pool's): each rank is its own
    # NIXL engine, picked with the X-data-parallel-rank header (docs/dispatch-and-failures.md)
    data_parallel_size: int | None = Field(default=None, ge=1, le=MAX_DATA_PARALLEL)

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        host, _ = parse_host_port(value)
        try:  # Envoy's pools take IP addresses only, and override_host matches by address
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"an IP address, not a name (got {value!r}); give names with dns: (or kubernetes:)"
            ) from None
        return value

    @property
    def host(self) -> str:
        return parse_host_port(self.address)[0]

    @property
    def port(self) -> int:
        return parse_host_port(self.address)[1]


def _endpoint(value: Any) -> Any:
    return {"address": value} if isinstance(value, str) else value


Endpoint = Annotated[EndpointConfig, Field()]


def _known_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; one of: {', '.join(POLICIES)}")
    return name


PolicyName = Annotated[str, AfterValidator(_known_policy)]  # a name in extproc.policies


class KubernetesSource(_Strict):
    """Pods of one role found by label selector (their pod IPs, `port`), watched."""

    namespace: str = "default"
    label_selector: str  # e.g. "app=vllm,role=prefill"
    port: int = Field(gt=0, lt=65536)


# llm-d's convention: the role label's values, and which pool takes each. A decode pool also
# takes "both" and pods without the label (llm-d's decode filter does the same); any other
# value belongs to no pool here.
ROLE_LABEL = "llm-d.ai/role"
UNLABELLED = ""  # in `roles`: a pod without the role label
DEFAULT_ROLES = {Role.PREFILL: ("prefill",), Role.DECODE: ("decode", "both", UNLABELLED)}


class InferencePoolSource(_Strict):
    """The pods of a Gateway API Inference Extension InferencePool (inference.networking.k8s.io
    v1) that carry this pool's role: the pool's selector picks the pods, its target port is the
    engines' port, and a pod label splits them into prefill and decode."""

    name: str
    namespace: str = "default"
    role_label: str = ROLE_LABEL
    # The label values this pool takes ("" = no label). None: llm-d's, see DEFAULT_ROLES.
    roles: list[str] | None = None

    def takes(self, role: Role, labels: dict[str, str]) -> bool:
        """A pod with `labels` belongs to this `role`'s pool."""
        wanted = DEFAULT_ROLES[role] if self.roles is None else self.roles
        return labels.get(self.role_label, UNLABELLED) in wanted


def _options(policy: str, keys: dict[str, Any]) -> BaseModel:
    try:
        return parse_options(policy, keys)
    except ValidationError as error:  # one line per key, named as the user wrote it
        raise ValueError(_format_errors(error).replace("\n", "; ")) from None


class KvEventsConfig(_Strict):
    """Route by the engines' KV caches: subscribe to the KV events every member publishes
    (vLLM's `--kv-events-config`), at `tcp://<member's host>:<port>`, whatever found the
    member (static endpoints, DNS, Kubernetes). See docs/kv-cache.md."""

    port: int = Field(default=5557, gt=0, lt=65536)  # the engines' ZMQ PUB `endpoint`
    replay_port: int | None = Field(default=5558, gt=0, lt=65536)  # `replay_endpoint`; null: none
    topic: str = ""
    # subscribe: the sidecar connects to each engine's PUB socket (`tcp://*:port` in vLLM's
    # config). listen: the engines connect to the sidecar's `kv_listener` with llm-d's topic
    # `kv@<pod IP>@<model>`; their replay sockets are asked only where replay_port is set.
    mode: Literal["subscribe", "listen"] = "subscribe"

    @model_validator(mode="before")
    @classmethod
    def _listen_replays_where_told(cls, data: Any) -> Any:
        """A connecting publisher's replay socket is asked only where replay_port is set."""
        if isinstance(data, dict) and data.get("mode") == "listen":
            return {"replay_port": None, **data}
        return data


class KvListenerConfig(_Strict):
    """Where the sidecar listens for the KV events of engines that connect to it (pools with
    `kv_events: {mode: listen}`); rank r of a data-parallel engine connects to `port + r`.
    Only the engines may reach it: keep it on loopback or a network only they are on."""

    host: str = "127.0.0.1"
    port: int = Field(default=5557, gt=0, lt=65536)
    # Set by `up` for its ext_proc processes (extproc.workers), not by hand: one binds the
    # port (listen) and passes what it receives on at `relay`, which the others read.
    listen: bool = True
    relay: str | None = None
    # A batch counts only if its connection comes from the IP its topic names; false where
    # the engines reach the sidecar through a proxy or NAT that hides their address.
    check_sender: bool = True

    @field_validator("host")
    @classmethod
    def _ip(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"an IP address to bind (got {value!r})") from None
        return value


class PoolConfig(_Strict):
    # Members: a static list, and/or a DNS name (a headless service) re-resolved every
    # discovery.interval_s, and/or Kubernetes pods, by label or as an InferencePool's pods of
    # this role (both watched: changes apply at once). At least one source.
    endpoints: list[Endpoint] = []
    dns: str | None = None  # "name:port"; every A/AAAA record is one endpoint
    kubernetes: KubernetesSource | None = None
    inference_pool: InferencePoolSource | None = None
    policy: PolicyName = "kv_cache"
    # The policy's options (extproc.policies: each policy's options model). Written flat in
    # the pool (`kv_usage_weight: 2`), or nested under `options:`; both forms are accepted.
    options: SerializeAsAny[BaseModel] = NoOptions()
    # KV events of the members (null: none read; the kv_cache policy then hashes prompts).
    kv_events: KvEventsConfig | None = None
    # vLLM's --data-parallel-size of every member (an endpoint's own value wins); null: learned
    # from each engine's /metrics (one `engine` label per rank) where it is scraped
    data_parallel_size: int | None = Field(default=None, ge=1, le=MAX_DATA_PARALLEL)

    @model_validator(mode="before")
    @classmethod
    def _policy_options(cls, data: Any) -> Any:
        """Gather the flat option keys into the chosen policy's options model.

        A key of another policy is still checked against its own model (a typo or a bad value
        fails at load, as before), then ignored.
        """
        if not isinstance(data, dict):
            return data
        data = dict(data)
        nested = data.pop("options", None) or {}
        if not isinstance(nested, dict):
            raise ValueError("options: expected a mapping")
        if "kv_cache_weight" in data or "kv_cache_weight" in nested:  # before 2026-12
            raise ValueError(
                "kv_cache_weight was replaced by kv_cached_token_weight (what a cached token is"
                " worth in queued tokens, default 2) and kv_request_tokens (default 64); see"
                " docs/kv-cache.md"
            )
        owners = option_keys()
        keys = {k: data.pop(k) for k in list(data) if k in owners} | nested
        policy = data.get("policy", "kv_cache")
        for owner in {owners.get(k, policy) for k in keys} | {policy}:
            if owner in POLICIES:
                mine = {k: v for k, v in keys.items() if owners.get(k, policy) == owner}
                options = _options(owner, mine)
                if owner == policy:
                    data["options"] = options
        return data

    @property
    def needs_load(self) -> bool:
        """Its policy reads engine load (the scraper keeps the members' load fresh)."""
        return POLICIES[self.policy].needs_load

    @property
    def load_interval_s(self) -> float:
        return float(getattr(self.options, "load_interval_s", 1.0))

    @model_validator(mode="after")
    def _has_a_source(self) -> PoolConfig:
        if not (self.endpoints or self.dns or self.kubernetes or self.inference_pool):
            raise ValueError("give endpoints, dns, kubernetes or inference_pool")
        return self

    @model_validator(mode="after")
    def _endpoint_ports_need_the_pool(self) -> PoolConfig:
        if self.kv_events is None and any(e.kv_events for e in self.endpoints):
            raise ValueError("an endpoint's kv_events ports need the pool's kv_events")
        return self

    @field_validator("dns")
    @classmethod
    def _check_dns(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @property
    def addresses(self) -> list[str]:
        """The static members (discovered ones come at run time)."""
        return [e.address for e in self.endpoints]

    @field_validator("endpoints", mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        return [_endpoint(v) for v in value] if isinstance(value, list) else value

    @field_validator("endpoints")
    @classmethod
    def _unique(cls, value: list[EndpointConfig]) -> list[EndpointConfig]:
        addresses = [e.address for e in value]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"endpoints listed twice: {sorted(addresses)}")
        return value


class TlsConfig(_Strict):
    """TLS between Envoy and the ext_proc (both sides are configured from these files)."""

    cert_file: str  # the ext_proc's certificate chain (PEM)
    key_file: str
    ca_file: str  # the CA Envoy trusts for the ext_proc's certificate
    server_name: str = "localhost"  # SNI and the name checked in the ext_proc's certificate
    # mTLS: Envoy's client certificate; the ext_proc then requires it (signed by ca_file)
    client_cert_file: str | None = None
    client_key_file: str | None = None


class ListenConfig(_Strict):
    host: str = "127.0.0.1"  # the ext_proc also takes "unix:/path" (then port is unused)
    port: int = Field(default=0, ge=0, lt=65536)

    @property
    def address(self) -> str:
        return self.host if self.host.startswith("unix:") else f"{self.host}:{self.port}"


class MetricsListenConfig(ListenConfig):
    """The operator's HTTP port: /metrics, /ready, /live (and Envoy's stats)."""

    # /ready?verbose answers with every engine's address, health, load and identity; off, only
    # whether the process is ready and why in a few words (the port may be open to a cluster).
    ready_detail: bool = False
    port: int = Field(default=9464, ge=0, lt=65536)


class IngressListenConfig(ListenConfig):
    """Envoy's client port."""

    port: int = Field(default=8000, ge=0, lt=65536)


class LoadTableConfig(_Strict):
    """Where the ext_proc processes of one `up` share their load counts (set by `up`)."""

    path: str
    rows: int = Field(ge=1, le=64)
    row: int = Field(ge=0, lt=64)


class ExtProcListenConfig(ListenConfig):
    # Each section's default port is its field's default, so that setting only its host (or
    # tls) keeps the documented port instead of the base class's 0 (an ephemeral port).
    port: int = Field(default=50051, ge=0, lt=65536)
    tls: TlsConfig | None = None  # plaintext by default: it listens on loopback or a socket
    # `up`: this many ext_proc processes (one core each), behind Envoy by least open streams;
    # "auto": the CPUs the process may use (affinity, cgroup CPU limit) less Envoy's worker
    # threads, at least 1. The extra ones listen on Unix sockets too, each with its own share of
    # the in-flight limits; the metrics port shows them all (docs/benchmarks.md, sizing).
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"  # 64: MAX_WORKERS
    # With several workers: each counts every process's requests in flight and their pending
    # and queued tokens at each engine (a table in `up`'s run directory), so that they pick
    # as one process would; false: each sees only its own.
    share_load: bool = True
    # Set by `up` for its ext_proc processes, not by hand: the shared table and this one's row.
    load_table: LoadTableConfig | None = None
    # serve, epp: the pools' EDS and the access-log service on a listener of their own
    # (loopback or unix:/path: it has no authentication), off the ext_proc's port, which may
    # then face other hosts. None: serve has them on the ext_proc's port, epp has none (a
    # gateway uses neither). `up` has everything on its private Unix socket.
    eds_access_log: ListenConfig | None = None

    @field_validator("eds_access_log")
    @classmethod
    def _local_only(cls, value: ListenConfig | None) -> ListenConfig | None:
        if value is None or value.host.startswith("unix:"):
            return value
        try:
            loopback = ipaddress.ip_address(value.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"host {value.host!r}: a loopback IP address or unix:/path (it has no auth)"
            )
        return value


class EndpointPickerConfig(_Strict):
    """`pd-extproc epp`: the ext_proc as the endpoint picker of a Gateway API Inference
    Extension pool, behind a gateway's Envoy (docs/deployment.md, "GIE InferencePool")."""

    # TLS on the ext_proc port, as the gateways connect: extproc.tls's certificate when given,
    # else a self-signed one made at start (the gateways do not verify it).
    secure_serving: bool = True
    # The CA of the gateway's client certificates (PEM): given, a client without a certificate
    # it signed is refused in the TLS handshake. None: any client that reaches the port.
    client_ca_file: str | None = None
    # Plaintext gRPC health (liveness, readiness) for Kubernetes gRPC probes, which cannot
    # speak TLS; on extproc.host (127.0.0.1 beside a Unix socket). 0: any free port; null: none
    # (the ext_proc port has them too).
    health_port: int | None = Field(default=9003, ge=0, lt=65536)
    # Other healthy decodes listed after the choice, for the gateway's retries. An Envoy whose
    # route cluster is ORIGINAL_DST takes a single address only: set 0 behind one.
    fallbacks: int = Field(default=1, ge=0, le=8)
    # The metadata namespaces of the protocol: the gateway's subset hint, our destination.
    subset_hint_namespace: str = "envoy.lb.subset_hint"
    destination_namespace: str = "envoy.lb"


class TracingConfig(_Strict):
    """OpenTelemetry spans per request, exported over OTLP/HTTP (needs the `otel` extra)."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "pd-extproc"


class AccessLogConfig(_Strict):
    """Envoy's access log of the ingress, streamed to the ext_proc over gRPC: the client's own
    time to first byte and duration, as metrics by strategy and model."""

    enabled: bool = True
    # How long Envoy may batch entries before sending them (it also sends when 16 KiB are due).
    flush_interval_s: Annotated[float, seconds(0.01, 60)] = 0.1


class LogConfig(_Strict):
    format: Literal["text", "json"] = "text"
    requests: bool = False  # one line per finished request (ids, dispatch, outcome)


# Headers about one connection or hop, not the request (RFC 9110 §7.6.1; Expect asks this hop
# for a 100 Continue).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
)
# Headers the sidecar or Envoy sets on the P leg itself, or that steer routing and identity.
_OWN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "content-encoding",
        "x-request-id",
        "forwarded",
        DESTINATION_HEADER,
        RANK_HEADER,
        LOCAL_REPLY_HEADER,
    }
)
_OWN_PREFIXES = (":", "x-envoy-", "x-forwarded-")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP field name (RFC 9110 §5.1)
_HEADER_VALUE = re.compile(r"[ -~]+", re.ASCII)  # printable ASCII: fits in any header


def _forwarding_problem(name: str) -> str | None:
    """Why `name` may not be forwarded to P, or None."""
    if name in _HOP_BY_HOP or name.startswith("proxy-"):
        return f"{name!r} is hop-by-hop (it describes one connection): never forwarded"
    if name in _OWN_HEADERS or name.startswith(_OWN_PREFIXES):
        return f"{name!r} is set by pd-extproc or Envoy (routing, identity): never forwarded"
    if not _TOKEN.fullmatch(name):
        return f"{name!r} is not a valid header name"
    return None


class DispatchConfig(_Strict):
    mode: DispatchMode = DispatchMode.AUTO
    # Learn a prefill's identity with a one-token probe as soon as it appears, so that the
    # first user request is already parallel.
    probe: bool = True
    # Identity changed this many times within `flap_window_s` (data-parallel ranks behind one
    # port): serve the endpoint serially for `serial_cooldown_s`.
    flap_threshold: int = Field(default=2, ge=1, le=_COUNT_BOUND)
    flap_window_s: Annotated[float, seconds(1, DAY)] = 60.0
    serial_cooldown_s: Annotated[float, seconds(1, DAY)] = 300.0
    # What to do when no prefill endpoint is healthy: refuse (503) or let D prefill itself.
    no_healthy_prefill: Literal["error", "decode_only"] = "error"
    # The header whose value the `session` policy hashes (sticky routing per conversation).
    session_header: str = "x-session-id"
    # Client headers copied onto the P leg (D gets every client header from Envoy anyway):
    # engines started with --api-key need the client's key on both legs, and vLLM continues
    # the client's OpenTelemetry trace from traceparent/tracestate, on P as on D.
    forward_headers: list[str] = ["authorization", "traceparent", "tracestate"]
    # How the P leg reaches the prefill engine: "direct" straight to the engine (less latency
    # and CPU: see docs/benchmarks.md; the only way where no prefill listener exists), or "listener"
    # through Envoy's prefill listener (Envoy's pooling, per-cluster stats, pool check).
    prefill_leg: Literal["listener", "direct"] = "direct"
    # vLLM's own priority (the body's `priority`, the X-Vllm-Priority header), which orders an
    # engine's queue under --scheduling-policy priority: a client's reaches the engines only
    # when the operator lets it (its gateway then sets or checks it); otherwise both are removed.
    client_engine_priority: bool = False

    @field_validator("forward_headers")
    @classmethod
    def _check_forward_headers(cls, value: list[str]) -> list[str]:
        names = list(dict.fromkeys(name.lower() for name in value))
        problems = [p for p in map(_forwarding_problem, names) if p is not None]
        if problems:
            raise ValueError("; ".join(problems))
        return names

    @model_validator(mode="after")
    def _check_engine_priority(self) -> DispatchConfig:
        if ENGINE_PRIORITY_HEADER in self.forward_headers and not self.client_engine_priority:
            raise ValueError(
                f"forward_headers lists {ENGINE_PRIORITY_HEADER!r}, which the engines never get "
                "from a client unless client_engine_priority is true: set it, or drop the header"
            )
        return self


class DecisionMode(StrEnum):
    """Whether a request with a healthy prefill engine may still be served by D alone."""

    OFF = "off"  # always disaggregate (decode-only only when no prefill engine is healthy)
    THRESHOLD = "threshold"  # decode-only for prompts of at most `max_prompt_tokens`
    LOAD_AWARE = "load_aware"  # decode-only when it is faster and D's stall stays in budget


class DecisionConfig(_Strict):
    """Per request: disaggregate, or let the decode engine prefill the prompt itself.

    The step costs describe the engines (defaults: vLLM with an 8B model on one H100, as
    vllmsim models it); `load_aware` turns queue, running requests and the prompt's size into
    expected times with them. See `extproc.scheduling.decision`.
    """

    mode: Annotated[DecisionMode, OffAsWritten] = DecisionMode.LOAD_AWARE  # YAML `off` is false
    # The prompt's token count is estimated as its JSON bytes / this (no tokenizer on the
    # request path); ~4 for English text with a BPE tokenizer.
    bytes_per_token: PositiveFloat = 4.0
    # threshold: decode-only for prompts up to this many (estimated) tokens.
    max_prompt_tokens: int = Field(default=256, ge=0, le=_TOKEN_BOUND)
    # load_aware: the engines' step cost: base + per prefill token + per running sequence.
    step_base_ms: float = Field(default=10.0, ge=0)
    prefill_per_token_ms: float = Field(default=0.058, ge=0)
    decode_per_seq_ms: float = Field(default=0.02, ge=0)
    max_batched_tokens: int = Field(default=2048, gt=0, le=_TOKEN_BOUND)
    # What the P/D path costs on top of P's prefill: the P leg's round trip, the KV
    # transfer and D's first step.
    pd_overhead_ms: float = Field(default=25.0, ge=0)
    # The stall budget of D's running requests: a decode-only prefill delays their next
    # token by its compute time. On average over time, at most this much per output token
    # (the TPOT cost), and never more than `max_stall_ms` for one token. 0.15 ms is 1.5 % of
    # a decode step; a stall of 10 ms at most keeps a short answer's TPOT within that too (the
    # lab's matrix, docs/lab.md: 0.3 and 30 ms gave TPOT p99 up to 1.09 x round robin's, 0.2
    # and 10 ms 1.020-1.022 in five cells).
    stall_budget_ms_per_token: float = Field(default=0.15, ge=0)
    max_stall_ms: float = Field(default=10.0, ge=0)
    # D's KV cache above this fill: no decode-only (a prefill there may preempt others).
    max_kv_usage: float = Field(default=0.9, ge=0, le=1)
    # load_aware: how often every engine's /metrics is scraped for its queue, batch and KV.
    load_interval_s: Annotated[float, INTERVAL] = 1.0


_PRIORITY_BOUND = 1000  # far beyond any useful number of levels


class AdmissionLimits(_Strict):
    """Saturation limits of one role's endpoints; None: not checked."""

    # requests the sidecar has in flight there (its ext_proc processes each admit their share)
    max_in_flight: int | None = Field(default=None, gt=0, le=_IN_FLIGHT_BOUND)
    max_waiting: float | None = Field(default=None, gt=0)  # vllm:num_requests_waiting
    max_kv_usage: float | None = Field(default=None, gt=0, le=1)  # vllm:kv_cache_usage_perc


class AdmissionConfig(_Strict):
    """Shed load (429 + Retry-After) when every endpoint of a role is at its limits.

    An endpoint's saturation is its highest load / limit ratio; a role's is that of its least
    saturated healthy endpoint. Priorities come only from `priority_header`, a header the
    gateway sets and strips from clients (none by default: every request has
    `priority_default`), clamped to [`priority_min`, `priority_max`]. A request of priority p
    is shed when a role's saturation reaches 1 - (`priority_max` - p) × `priority_step`: the
    top priority at 100 % of the limits, the next at 75 % (with the default step), and so on;
    none above the limits.
    """

    enabled: bool = False
    decode: AdmissionLimits = AdmissionLimits()
    prefill: AdmissionLimits = AdmissionLimits()
    priority_header: str | None = None  # set by the gateway, never by a client; an integer
    priority_default: int = Field(default=0, ge=-_PRIORITY_BOUND, le=_PRIORITY_BOUND)
    priority_min: int = Field(default=-3, ge=-_PRIORITY_BOUND, le=_PRIORITY_BOUND)
    priority_max: int = Field(default=0, ge=-_PRIORITY_BOUND, le=_PRIORITY_BOUND)
    priority_step: float = Field(default=0.25, gt=0, le=1)
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    # how often every engine's /metrics is scraped
    load_interval_s: Annotated[float, INTERVAL] = 1.0

    @field_validator("priority_header")
    @classmethod
    def _check_priority_header(cls, value: str | None) -> str | None:
        if value is None:
            return value
        name = value.lower()
        if not _TOKEN.fullmatch(name) or name.startswith(":"):
            raise ValueError(f"{value!r} is not a valid header name")
        return name

    @model_validator(mode="after")
    def _check_priorities(self) -> AdmissionConfig:
        low, high = self.priority_min, self.priority_max
        if not low <= self.priority_default <= high:
            raise ValueError(
                f"priority_default {self.priority_default} is outside priority_min {low} .. "
                f"priority_max {high}"
            )
        lowest = 1 - (high - low) * self.priority_step
        if lowest <= 1e-9:
            raise ValueError(
                f"priority_min {low} would be shed at {max(lowest, 0):.0%} of the limits (even "
                f"on idle engines) with priority_max {high} and priority_step "
                f"{self.priority_step:g}: raise priority_min or lower priority_step"
            )
        return self


class TimeoutConfig(_Strict):
    # P leg, from sending to P's complete answer (Envoy's ext_proc timers stop at 3600 s)
    prefill_s: Annotated[float, seconds(0.01, 3000)] = 30.0
    probe_s: Annotated[float, seconds(0.1, 600)] = 10.0
    connect_s: Annotated[float, seconds(0.01, 60)] = 1.0
    # Envoy's per-message ext_proc timer; the body answer is extended to `prefill_s` in serial
    # dispatch (override_message_timeout). None: sized from limits.max_body_bytes, so that a
    # burst of large bodies fits (see bootstrap.ext_proc_filter.extproc_message_timeout_s).
    extproc_message_s: Annotated[float, seconds(0.001, 3600)] | None = None
    drain_s: Annotated[float, seconds(0.1, DAY)] = 10.0
    # D failed in parallel dispatch: wait this long for P's answer to tell a P restart
    # (answer 503 + Retry-After) from a D fault (pass D's error on, cancel P).
    decode_error_grace_s: Annotated[float, seconds(0.01, 60)] = 0.5
    # Longest silence from D (before its first byte, or between chunks). vLLM has no timeout
    # for a decode waiting on KV that never comes; Envoy answers 504 (or resets a started
    # stream) after this. Non-streaming answers are silent until done: keep it above them.
    kv_wait_s: Annotated[float, seconds(0.1, DAY)] = 300.0
    # How long after P's answer its pushed KV may still be on its way to a streaming D while P
    # lives: a P seen restarted or down before that ends those streams at once
    # (extproc.request.pushed_kv)
    pushed_kv_s: Annotated[float, seconds(0.1, 600)] = 1.0
    # Longest a request may stay open (a long generation); then the sidecar stops watching it.
    request_s: Annotated[float, seconds(0.1, 7 * DAY)] = 3600.0
    # Streamed request body (the LLM routes): longest silence while the client's body comes in;
    # then the request ends with 408 (Envoy runs no timer of its own on a streamed body).
    upload_idle_s: Annotated[float, seconds(0.05, 3600)] = 30.0
    # ... and longest the whole body may take to arrive, from its headers (a slow drip; 408)
    upload_s: Annotated[float, seconds(0.05, 3600)] = 30.0


class HealthConfig(_Strict):
    interval_s: Annotated[float, INTERVAL] = 2.0
    timeout_s: Annotated[float, seconds(0.01, 60)] = 1.0
    unhealthy_after: int = Field(default=2, ge=1, le=_COUNT_BOUND)  # consecutive failed checks


class KvCheckConfig(_Strict):
    """Scrape decode engines' prompt-token sources to catch P/D that silently recomputes."""

    enabled: bool = True
    interval_s: Annotated[float, INTERVAL] = 10.0
    min_share: float = Field(default=0.5, ge=0, le=1)  # below this share of KV-transferred
    # prompt tokens, with disaggregated requests in the window, the sidecar warns


class DiscoveryConfig(_Strict):
    interval_s: Annotated[float, INTERVAL] = 5.0  # how often DNS names are re-resolved
    # Kubernetes sources are watched; the API server ends each watch after this long (the
    # watch then resumes where it was), so a silently dead connection is noticed in bounded time.
    watch_timeout_s: int = Field(default=300, ge=10, le=3600)
    # Kubernetes API access (in a pod: the service account's token and CA are used)
    kubernetes_api: str = "https://kubernetes.default.svc"
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

    @field_validator("kubernetes_api")
    @classmethod
    def _check_api_url(cls, value: str) -> str:
        try:
            url = urllib.parse.urlsplit(value)
            url.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"an http:// or https:// URL of the API server (got {value!r})")
        return value


_BODY_BUDGET = 256 * 1024 * 1024


class LimitConfig(_Strict):
    # at most 1 GiB: Envoy's buffers, an eighth larger (extproc.protocol.bodies.buffer_bytes),
    # are 32-bit
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0, le=1024**3)
    # the client bodies the sidecar holds at once, across its requests (each until it ends;
    # its ext_proc processes each hold their share); a body that would pass it gets 503 +
    # Retry-After. At least max_body_bytes; None: 256 MiB, or max_body_bytes if that is larger.
    max_body_bytes_in_flight: int | None = Field(default=None, gt=0, le=1024**4)

    @model_validator(mode="after")
    def _room_for_one_body(self) -> LimitConfig:
        budget = self.max_body_bytes_in_flight
        if budget is not None and budget < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({budget}) must be at least max_body_bytes "
                f"({self.max_body_bytes}), or no body of that size could pass"
            )
        return self

    @property
    def body_budget_bytes(self) -> int:
        budget = self.max_body_bytes_in_flight
        return max(_BODY_BUDGET, self.max_body_bytes) if budget is None else budget


SHARED_PREFILL_LISTENER = "127.0.0.1:10001"


def _loopback_listener(value: str) -> str:
    """The prefill listener has no authentication: loopback or a Unix socket only."""
    if not value.startswith("unix:"):
        host, _ = parse_host_port(value)
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError("must be a loopback address or unix:/path (it has no auth)")
    return value


class EnvoyConfig(_Strict):
    listen: IngressListenConfig = IngressListenConfig()
    admin: ListenConfig = ListenConfig()
    # Where Envoy listens for the ext_proc's prefill requests: "unix:/path" or "127.0.0.1:port".
    # Empty: `up` uses a Unix socket in its run directory, which nothing outside this host
    # reaches; `serve` and `render-envoy`, whose Envoy is the user's, use SHARED_PREFILL_LISTENER.
    prefill_listener: str = ""
    # Envoy's worker threads (--concurrency); one per core at most is useful
    concurrency: int = Field(default=1, ge=1, le=MAX_ENVOY_CONCURRENCY)
    log_level: Annotated[
        Literal["trace", "debug", "info", "warning", "error", "critical", "off"], OffAsWritten
    ] = "warning"

    def shared_prefill_listener(self, override: str | None = None) -> str:
        """The address `serve` sends P legs to and `render-envoy` renders: flag, config, default.

        One rule for both commands, so that the rendered Envoy and the ext_proc agree.
        """
        if override:
            try:
                return _loopback_listener(override)
            except ValueError as error:
                raise ConfigError(f"--prefill-listener {override}: {error}") from None
        return self.prefill_listener or SHARED_PREFILL_LISTENER

    @field_validator("prefill_listener")
    @classmethod
    def _check_prefill_listener(cls, value: str) -> str:
        return _loopback_listener(value) if value else value


_MAX_KEY_FILE_BYTES = 64 * 1024  # thousands of keys


class EnginesConfig(_Strict):
    """How the sidecar itself talks to the engines (not the client's requests)."""

    # The keys the engines were started with (vLLM --api-key, which takes several), one a line;
    # the sidecar's own /v1 requests (the identity probe) send the first. Health checks and
    # metric scrapes use /health and /metrics, which vLLM serves without a key. Read when the
    # config is loaded (a reload re-reads it).
    api_key_file: str | None = None
    _api_keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _read_api_keys(self) -> EnginesConfig:
        if self.api_key_file is None:
            return self
        try:
            with Path(self.api_key_file).open("rb") as file:  # /dev/zero would never end
                data = file.read(_MAX_KEY_FILE_BYTES + 1)
            text = data.decode()
        except (OSError, UnicodeDecodeError) as error:
            why = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise ValueError(f"api_key_file {self.api_key_file} cannot be read ({why})") from None
        if len(data) > _MAX_KEY_FILE_BYTES:
            raise ValueError(
                f"api_key_file {self.api_key_file} is larger than {_MAX_KEY_FILE_BYTES} bytes: "
                "give a file of keys, one a line"
            )
        keys = tuple(line.strip() for line in text.splitlines() if line.strip())
        if not keys:
            raise ValueError(f"api_key_file {self.api_key_file} is empty")
        if any(not _HEADER_VALUE.fullmatch(key) for key in keys):
            raise ValueError(
                f"api_key_file {self.api_key_file}: a key may hold only printable ASCII "
                "characters (one key a line)"
            )
        self._api_keys = keys
        return self

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key the engines accept (none without a key file)."""
        return self._api_keys

    @property
    def auth_headers(self) -> dict[str, str]:
        """The Authorization header of the sidecar's own engine requests (none without a key)."""
        return {"authorization": f"Bearer {self._api_keys[0]}"} if self._api_keys else {}


def _tokenizer_path(value: str | None) -> str | None:
    """A model folder holding tokenizer.json, or the tokenizer.json file itself."""
    if value is None:
        return value
    path = Path(value).expanduser()
    if not (path.is_file() or (path / "tokenizer.json").is_file()):
        raise ValueError(
            f"{value}: no tokenizer.json there; give the model's folder "
            "(as for vllm serve --tokenizer) or its tokenizer.json"
        )
    return value


TokenizerPath = Annotated[str | None, AfterValidator(_tokenizer_path)]


class KvIndexConfig(_Strict):
    """The index of what the engines' KV caches hold (docs/kv-cache.md)."""

    # (engine, block) entries kept; ~35-50 bytes each (docs/kv-cache.md, "What it costs")
    max_blocks: int = Field(default=500_000, ge=1, le=100_000_000)


class ModelConfig(_Strict):
    """The pools of one model (`models:`): requests naming it go only to these engines."""

    prefill: PoolConfig
    decode: PoolConfig
    # The model's tokenizer (a local folder or tokenizer.json), for KV-cache routing; None:
    # the top-level `tokenizer`.
    tokenizer: TokenizerPath = None

    @property
    def kv_events(self) -> bool:
        return self.prefill.kv_events is not None or self.decode.kv_events is not None


class Config(_Strict):
    """Everything the sidecar needs; see docs/configuration.md."""

    # The pools of every model not listed under `models` (or of all, when there is none).
    prefill: PoolConfig
    decode: PoolConfig
    models: dict[str, ModelConfig] = {}
    # The tokenizer of the top-level pools' model, and of `models:` without their own: a local
    # folder (tokenizer.json, tokenizer_config.json, chat template) or a tokenizer.json. KV-cache
    # routing (a pool's kv_events) needs the ids the engines hash.
    tokenizer: TokenizerPath = None
    kv_index: KvIndexConfig = KvIndexConfig()
    kv_listener: KvListenerConfig = KvListenerConfig()
    dispatch: DispatchConfig = DispatchConfig()
    decision: DecisionConfig = DecisionConfig()
    admission: AdmissionConfig = AdmissionConfig()
    engines: EnginesConfig = EnginesConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    health: HealthConfig = HealthConfig()
    kv_check: KvCheckConfig = KvCheckConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    log: LogConfig = LogConfig()
    tracing: TracingConfig = TracingConfig()
    access_log: AccessLogConfig = AccessLogConfig()
    limits: LimitConfig = LimitConfig()
    extproc: ExtProcListenConfig = ExtProcListenConfig()
    endpoint_picker: EndpointPickerConfig = EndpointPickerConfig()
    metrics: MetricsListenConfig = MetricsListenConfig()
    envoy: EnvoyConfig = EnvoyConfig()

    @field_validator("models")
    @classmethod
    def _named_models(cls, value: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in value:
            if not name.strip() or name != name.strip():
                raise ValueError(
                    f"{name!r}: a model name as clients send it in `model` (not empty, no "
                    "surrounding spaces)"
                )
        return value

    @model_validator(mode="after")
    def _client_ca_needs_tls(self) -> Config:
        picker = self.endpoint_picker
        plaintext = not picker.secure_serving and self.extproc.tls is None
        if picker.client_ca_file is not None and plaintext:
            raise ValueError(
                "endpoint_picker.client_ca_file verifies clients over TLS: set "
                "secure_serving: true or extproc.tls"
            )
        return self

    @model_validator(mode="after")
    def _pools_disjoint(self) -> Config:
        seen: dict[str, str] = {}
        for model, group in self.groups().items():
            for role, pool in ((Role.PREFILL, group.prefill), (Role.DECODE, group.decode)):
                for address in pool.addresses:
                    where = f"{model or 'default'} {role}"
                    if seen.setdefault(address, where) != where:
                        raise ValueError(f"{address} is both {seen[address]} and {where}")
        return self

    def groups(self) -> dict[str, ModelConfig]:
        """Model name → its pools; "" is the default group (top-level prefill/decode)."""
        default = ModelConfig.model_construct(  # validated already, as the top-level fields
            prefill=self.prefill, decode=self.decode, tokenizer=self.tokenizer
        )
        return {"": default, **self.models}

    def tokenizer_of(self, model: str) -> str | None:
        """The tokenizer of group `model` ("" the default group)."""
        group = self.groups().get(model)
        return (group.tokenizer if group is not None else None) or self.tokenizer

    def pool_configs(self, role: Role) -> list[PoolConfig]:
        return [getattr(group, role) for group in self.groups().values()]

    def static_addresses(self, role: Role) -> list[str]:
        return [a for pool in self.pool_configs(role) for a in pool.addresses]


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(error)) from None


def load_config(path: str | Path) -> Config:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_config(data, str(path))
