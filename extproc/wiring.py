"""Config → the live objects one ext_proc process shares between its streams.

This is the one module that builds the request path's and the background loops' objects (the
scheduler that picks a request's endpoints among them is `extproc.scheduling.scheduler`);
everything else receives what it needs through its constructor (often a small Protocol the
consumer declares) and imports nothing from here. A reload builds the config-derived state
anew and swaps it in; `RELOAD` says how each setting is taken, and a setting that needs a
restart is reported, never skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp

from extproc.config import Config, ConfigError
from extproc.engines.base_models import BaseModels
from extproc.engines.context import ContextLengths, served_context
from extproc.engines.health import HealthChecker
from extproc.engines.kv_check import KvCheck
from extproc.engines.kv_compat import KvCompatibility
from extproc.engines.load import EngineLoad
from extproc.engines.probe import Prober
from extproc.engines.restarts import RestartDetector
from extproc.engines.scrape_plan import scrape_plan
from extproc.engines.scraper import EngineScraper
from extproc.engines.startup_summary import startup_summary, summary_is_clean
from extproc.kvcache.index import KvIndex
from extproc.kvcache.listener import EventListener
from extproc.kvcache.routing import KvRouting, approximated_groups, event_sources, kv_groups
from extproc.kvcache.watchers import KvEventWatchers
from extproc.membership.discovery import Discovery
from extproc.membership.eds import Memberships, pool_cluster_name
from extproc.metrics import Metrics
from extproc.model_labels import ModelLabels
from extproc.protocol.identity import IdentityCache, of_where
from extproc.request.access_log import AccessLogStreams
from extproc.request.body_budget import BodyBudget
from extproc.request.prefill_client import (
    PrefillClient,
    PrefillPaths,
    ThroughListener,
    ToEngine,
    TrackedPrefillSender,
)
from extproc.request.processor import RequestDeps
from extproc.request.pushed_kv import PushedKv
from extproc.request.strategies import LegServices
from extproc.roles import Role
from extproc.scheduling.pool import EndpointState, Pool
from extproc.scheduling.scheduler import Scheduler, pool_picker
from extproc.scheduling.shared_load import SharedLoad
from extproc.tracing import Tracing

__all__ = ["RELOAD", "Runtime"]

log = logging.getLogger("extproc")

LIVE = "live"  # a request reads its snapshot, taken when it starts; the loops read it now
REBUILT = "rebuilt"  # config-derived state, built anew by a reload and swapped in
RESTART = "restart"  # fixed at start (Envoy's bootstrap, listeners, logging, the tracer)

# How a reload takes each setting: a section, or "section.field" where the fields differ.
# tests/extproc/test_wiring.py checks that every field of Config is covered.
RELOAD: dict[str, str] = {
    "prefill": REBUILT,  # policies, per-endpoint modes; members through discovery
    "decode": REBUILT,
    "models": REBUILT,
    "tokenizer": REBUILT,  # KV-cache routing's tokenizers, loaded anew for a new path
    "kv_index": RESTART,  # the index is built once
    "kv_listener": RESTART,  # its sockets are bound once
    "dispatch": LIVE,
    "dispatch.mode": REBUILT,
    "dispatch.flap_threshold": REBUILT,  # the identity cache's flap settings
    "dispatch.flap_window_s": REBUILT,
    "dispatch.serial_cooldown_s": REBUILT,
    "decision": LIVE,
    "admission": LIVE,
    "engines": LIVE,
    "timeouts": LIVE,
    # rendered into Envoy's bootstrap
    "timeouts.connect_s": RESTART,
    "timeouts.extproc_message_s": RESTART,
    "timeouts.kv_wait_s": RESTART,
    "timeouts.prefill_s": RESTART,
    "health": LIVE,
    "kv_check": LIVE,  # its loop runs always; a round does nothing while disabled
    "discovery": LIVE,  # a reload starts and stops watches, DNS rounds read the config now
    "log": LIVE,
    "log.format": RESTART,  # the log handlers are set up once
    "tracing": RESTART,  # the exporter is set up once; spans in flight belong to it
    "access_log": RESTART,  # rendered into Envoy's bootstrap
    "limits": LIVE,
    "limits.max_body_bytes": RESTART,  # Envoy's buffer sizes
    "extproc": RESTART,
    "endpoint_picker": LIVE,
    "endpoint_picker.secure_serving": RESTART,  # the ports are bound once
    "endpoint_picker.health_port": RESTART,
    "endpoint_picker.client_ca_file": RESTART,  # the TLS credentials are made once
    "metrics": LIVE,  # ready_detail is read per /ready?verbose
    "metrics.host": RESTART,  # the port is bound once
    "metrics.port": RESTART,
    "envoy": RESTART,
}


def needs_restart(old: Config, new: Config) -> list[str]:
    """The settings that differ between `old` and `new` and take a restart to apply."""
    changed = []
    for key, rule in RELOAD.items():
        if rule != RESTART:
            continue
        section, _, field = key.partition(".")
        before, after = getattr(old, section), getattr(new, section)
        if field:
            before, after = getattr(before, field), getattr(after, field)
        if before != after:
            changed.append(key)
    return changed


def _endpoint_view(state: EndpointState) -> dict[str, object]:
    return {
        "healthy": state.healthy,
        "in_flight": state.in_flight,
        "waiting": state.waiting,
        "kv_usage": state.kv_usage,
    }


def _shared_load(config: Config) -> SharedLoad | None:
    """This process's row of the table `up`'s ext_procs share (None: not one of several)."""
    table = config.extproc.load_table
    if table is None or not config.extproc.share_load:
        return None
    try:
        return SharedLoad.open(Path(table.path), table.rows, table.row, time.monotonic)
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise ConfigError(
            f"extproc.load_table: cannot map {table.path} ({reason}); `up` sets it for its "
            "ext_proc processes: leave it out of your config"
        ) from None


class Runtime:
    def __init__(
        self, config: Config, prefill_listener: str, endpoint_picker: bool = False
    ) -> None:
        self.config = config
        self.metrics = Metrics()
        dispatch = config.dispatch
        self.pushed_kv = PushedKv()  # what the prefills still owe open streams
        self.identities = IdentityCache(
            dispatch.flap_threshold,
            dispatch.flap_window_s,
            dispatch.serial_cooldown_s,
            on_event=self._identity_event,
        )
        settings = self._current_config
        self.prefill = Pool(
            Role.PREFILL,
            config.static_addresses(Role.PREFILL),
            pool_picker(config.prefill),
            on_change=self._endpoint_changed(Role.PREFILL),
        )
        self.decode = Pool(
            Role.DECODE,
            config.static_addresses(Role.DECODE),
            pool_picker(config.decode),
            on_change=self._endpoint_changed(Role.DECODE),
        )
        # with other ext_proc processes (`up`'s workers): one view of the engines' load
        self.shared_load = _shared_load(config)
        for pool in (self.prefill, self.decode):
            pool.share(self.shared_load)
        # KV-cache routing: an index of what the engines hold, fed by their KV events
        index = KvIndex(config.kv_index.max_blocks)
        listening = config.kv_listener
        listener = EventListener(
            listening.host,
            listening.port,
            index,
            self.metrics,
            listen=listening.listen,
            relay=listening.relay,
            check_sender=listening.check_sender,
        )
        self.kv = KvRouting(
            index, self.metrics, KvEventWatchers(index, self.metrics, listener=listener)
        )
        self.kv.configure(kv_groups(config), approximated_groups(config))
        self.scheduler = Scheduler(config, self.prefill, self.decode, self.metrics, self.kv)
        for pool in (self.prefill, self.decode):
            for state in pool:
                self._endpoint_changed(pool.role)(state)
        self.metrics.in_flight.read = self._in_flight_counts
        self.prefill_client = PrefillPaths(
            PrefillClient(ThroughListener(prefill_listener, config.timeouts.connect_s)),
            PrefillClient(ToEngine(config.timeouts.connect_s)),
            no_listener=endpoint_picker,  # an endpoint picker's P legs go to the engine
        )
        self.model_labels = ModelLabels(lambda: self.config.models.keys())
        self.kv_compat = KvCompatibility()  # P/D pairs the probe saw fail to exchange KV
        prober = Prober(
            self.prefill_client,
            self.identities,
            self.decode,
            self.scheduler.decodes_of,
            self.metrics,
            settings,
            self.model_labels.served,
            self.kv_compat,
            self._prefill_ranks,
            self._context_length,
            self.kv.learn_base_names,
        )
        self.kv_check = KvCheck(
            lambda: self.config.kv_check, self.metrics, lambda a: a in self.decode.addresses
        )
        self.restarts = RestartDetector(
            lambda a: a in self.prefill.addresses or a in self.kv.watched, self._restarted
        )
        self.scraper = EngineScraper(
            lambda: self._session,
            lambda: scrape_plan(
                self.config,
                {name: g.members for name, g in self.scheduler.groups.items()},
                self.decode.addresses,
            ),
            lambda: self.config.health.timeout_s,
            [
                self.restarts,
                EngineLoad(self._endpoint_state, lambda address: self._follow_kv_events()),
                self.kv_check,
                BaseModels(self.kv.learn_base_model),
            ],
        )
        # every engine's context length: a prompt that fits none is refused untokenized
        self.context_lengths = ContextLengths(
            self.kv.engine_context,
            lambda session, address: served_context(
                session, address, self.config.health.timeout_s, self.config.engines.auth_headers
            ),
        )
        probe_refused: set[str] = set()  # endpoints that refused the probe's API key
        self.health = HealthChecker(
            lambda: self.config.health,
            self.prefill,
            self.decode,
            self.identities,
            self.scraper.check,
            lambda session, a: prober.probe(session, a, probe_refused),
            lambda: self.config.dispatch.probe,
            lambda prefill: bool(self.kv_compat.involving(prefill)),
            self._prefill_ranks,
            self.context_lengths.health,
        )
        self.discovery = Discovery(self, settings)
        self.tracing = Tracing(config.tracing)
        self.access_log_streams = AccessLogStreams()  # Envoy's, which decide answers' outcomes
        self.request_deps = RequestDeps(
            LegServices(
                TrackedPrefillSender(self.prefill_client, self._prefill_state),
                self.identities,
                lambda prefill: self.prefill.set_healthy(prefill, False),
                self.kv_check.note_dispatch,
                self.metrics,
                self.kv_check.note_decode_only,
                self.pushed_kv,
            ),
            self.scheduler,
            self.tracing.request,
            self.metrics,
            settings,
            endpoint_picker,
            self.model_labels.label,
            self.kv_compat.client_message,
            self.access_log_streams,
            BodyBudget(),
        )
        bodies = self.request_deps.bodies
        self.metrics.body_bytes.set_function(lambda: bodies.in_use)
        # What Envoy's pool clusters receive over EDS; every membership change lands here.
        self.memberships = Memberships()
        for pool in (self.prefill, self.decode):
            self.memberships.publish(pool_cluster_name(pool.role), pool.addresses)
        self._session: aiohttp.ClientSession | None = None
        self.active_streams = 0  # Envoy streams being processed (= requests in flight)
        self.idle = asyncio.Event()  # set while no stream is open (drain waits on it)
        self.idle.set()
        self.serving = False  # set once start() has run: health known, probes settled
        self.draining = False  # set when shutdown begins: no new requests from here on

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Count one open Envoy stream for the whole of its processing."""
        self.active_streams += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active_streams -= 1
            if not self.active_streams:
                self.idle.set()

    def _current_config(self) -> Config:
        return self.config

    def _prefill_ranks(self, address: str) -> int:
        return self.scheduler.data_parallel_size(Role.PREFILL, address)

    def _context_length(self, address: str, tokens: int) -> None:
        """A prefill said how long a prompt it runs: bounds what its model's requests are
        tokenized for (`KvRouting.context_length`)."""
        self.kv.context_length(self.scheduler.group_of(Role.PREFILL, address).name, tokens)
        self.kv.engine_context(address, tokens)

    def _identity_event(self, endpoint: str, event: str) -> None:
        self.metrics.identity_events.labels(endpoint, event).inc()  # rare: not kept
        if event in ("changed", "flapping", "dropped"):
            log.info("prefill %s: identity %s", endpoint, event)
        identity = self.identities.get(*of_where(endpoint))  # `endpoint` names the rank too
        if identity is None or event not in ("refreshed", "learned", "changed"):
            return
        if event == "changed":  # the engine before it is gone
            self._pushes_lost(endpoint, self.pushed_kv.engine_changed(endpoint, identity.engine_id))
        self.pushed_kv.seen_alive(endpoint, identity.engine_id)

    def _pushes_lost(self, endpoint: str, streams: int) -> None:
        if streams:
            log.warning(
                "prefill %s: the engine that owed %d streaming answers their KV is gone;"
                " they are ended",
                endpoint,
                streams,
            )

    def _restarted(self, address: str) -> None:
        """A new process start time: the prefill identity is stale before any request, and
        what the engine's KV cache held is gone."""
        self.kv.engine_restarted(address)
        self.context_lengths.forget(address)
        if address in self.prefill.addresses:
            self.metrics.identity_events.labels(address, "restarted").inc()
            self.identities.drop(address)

    def _follow_kv_events(self) -> None:
        """Subscribe to the KV events of every member of a pool with kv_events (each rank of
        a data-parallel one: called again when a page shows its ranks)."""
        members = {name: g.members for name, g in self.scheduler.groups.items()}
        self.kv.follow(
            event_sources(
                self.config, members, self.kv.routed_groups, self.scheduler.data_parallel_size
            )
        )

    def _in_flight_counts(self) -> Iterator[tuple[str, str, int]]:
        for pool in (self.prefill, self.decode):
            for state in pool:
                yield pool.role, state.address, state.in_flight

    def _endpoint_state(self, address: str) -> EndpointState | None:
        return next(
            (s for pool in (self.prefill, self.decode) for s in pool if s.address == address), None
        )

    def _prefill_state(self, address: str) -> EndpointState | None:
        return next((s for s in self.prefill if s.address == address), None)

    def _endpoint_changed(self, role: Role) -> Callable[[EndpointState], None]:
        def record(state: EndpointState) -> None:
            self.metrics.endpoint_health(role, state.address, state.healthy)
            if role is Role.PREFILL and not state.healthy:  # what it still owed will not come
                self._pushes_lost(state.address, self.pushed_kv.endpoint_down(state.address))

        return record

    def set_group_members(self, model: str, role: Role, members: list[str]) -> None:
        self.scheduler.set_group_members(model, role, members)

    def pool(self, role: Role) -> Pool:
        return self.prefill if role == Role.PREFILL else self.decode

    def set_members(self, role: Role, members: list[str]) -> None:
        """Apply a pool's membership from discovery or a reload."""
        pool = self.pool(role)
        added, removed = pool.update(members)
        for address in removed:
            log.info("%s %s left the pool", role, address)
            self.identities.forget(address)
            self.pushed_kv.forget(address)
            self.kv_compat.forget(address)
            self.kv_check.forget(address)
            self.scheduler.forget(address)
            self.restarts.forget(address)
            self.kv.forget(address)
            self.context_lengths.forget(address)
            self.metrics.forget_endpoint(role, address)
        for address in added:
            log.info("%s %s joined the pool", role, address)
        self._follow_kv_events()
        if added or removed:
            self.memberships.publish(pool_cluster_name(role), pool.addresses)
            if self._session is not None:
                self.health.check_soon()  # new members are unhealthy until checked

    async def discover(self) -> None:
        """The first membership, before Envoy can ask for it over EDS."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await self.discovery.refresh()

    def reload(self, config: Config) -> list[str]:
        """Take a new config for new requests; returns the settings that need a restart.

        Everything is built before anything is swapped, so a failure leaves the old state.
        """
        restart = needs_restart(self.config, config)
        self.scheduler.reload(config)  # builds everything before it swaps
        self.kv.configure(kv_groups(config), approximated_groups(config))
        dispatch = config.dispatch
        self.config = config  # the KV subscribers follow at discovery's refresh, which follows
        self.identities.set_flap_limits(
            dispatch.flap_threshold, dispatch.flap_window_s, dispatch.serial_cooldown_s
        )
        return restart

    async def start(self) -> None:
        """Health checks, identity probes, KV checks, discovery; once Envoy is serving."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        if self.shared_load is not None:
            self.shared_load.start()
        self.kv.start()
        self._follow_kv_events()
        self.discovery.start()
        await self.health.start(self._session)
        await self.scraper.start()
        await self.health.probes_settled(self.config.timeouts.probe_s)
        self.serving = True
        self._log_summary()

    def _log_summary(self) -> None:
        summary = startup_summary(
            self.prefill,
            self.decode,
            self.health.reasons,
            self.identities.get,
            lambda address: str(self.scheduler.prefill_mode(address)),
            self.kv_compat,
        )
        log.log(logging.INFO if summary_is_clean(summary) else logging.WARNING, "%s", summary)

    async def stop(self) -> None:
        await self.discovery.stop()
        if self.shared_load is not None:
            await self.shared_load.stop()
        await self.kv.stop()
        await self.scraper.stop()
        await self.health.stop()
        await self.prefill_client.close()
        if self._session is not None:
            await self._session.close()
        await asyncio.to_thread(self.tracing.shutdown)  # flushes the last spans

    def engines_ready(self) -> bool:
        """A request can be dispatched now: a healthy decode engine, and a healthy prefill
        one unless dispatch.no_healthy_prefill lets the decode prefill itself."""
        decode = any(s.healthy for s in self.decode)
        prefill = any(s.healthy for s in self.prefill)
        return decode and (prefill or self.config.dispatch.no_healthy_prefill == "decode_only")

    def readiness(self) -> dict[str, object]:
        """What /ready shows to anyone: ready or not, and why in a few words (no address, no
        count). `ready` is "this process answers Envoy", not "an engine is up": with no
        healthy engine the ext_proc still answers every request (a JSON 503), which a pod taken
        out of its Service could not do. Engine health is in `engines_ready`."""
        ready = self.serving and not self.draining
        engines = self.engines_ready()
        if self.draining:
            reason = "draining: shutting down"
        elif not self.serving:
            reason = "starting: engine health and identity probes not settled yet"
        elif not engines:
            reason = "serving, but no engine can take a request now (clients get a JSON 503)"
        else:
            reason = "serving"
        return {"ready": ready, "reason": reason, "engines_ready": engines}

    def readiness_detail(self) -> dict[str, object]:
        """/ready?verbose, for the operator (metrics.ready_detail): every engine's address,
        health, load and identity."""
        return {
            **self.readiness(),
            "draining": self.draining,
            "active_streams": self.active_streams,
            # requests whose outcome waits for Envoy's access-log entry (exact with one process)
            "awaiting_access_log": self.access_log_streams.awaiting,
            "prefill": {s.address: _endpoint_view(s) for s in self.prefill},
            "decode": {s.address: _endpoint_view(s) for s in self.decode},
            "identities": self.identities.snapshot(),
            "decode_kv": self.kv_check.snapshot(),
            "kv_mismatch": self.kv_compat.snapshot(),  # P/D pairs that cannot exchange KV
        }
