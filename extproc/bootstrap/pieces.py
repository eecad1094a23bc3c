"""Every piece of pd-extproc's Envoy configuration for one config, by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.bootstrap.clusters import (
    EDS_ACCESS_LOG_CLUSTER,
    eds_access_log_cluster,
    extproc_cluster,
    pool_cluster,
)
from extproc.bootstrap.ext_proc_filter import EXTPROC_CLUSTER, ext_proc_filter
from extproc.bootstrap.listeners import ingress_hcm_settings, prefill_listener
from extproc.bootstrap.routes import (
    catch_all_route,
    llm_routes,
    passthrough_routes,
    without_extproc,
)
from extproc.config import Config
from extproc.membership.eds import pool_cluster_name
from extproc.roles import Role

Json = dict[str, Any]


@dataclass(frozen=True)
class EnvoyPieces:
    """The objects the bootstrap, the snippet and the mesh examples are assembled from."""

    ingress_hcm_settings: Json  # merged into the ingress http_connection_manager
    ext_proc_filter: Json  # goes before the router
    llm_routes: list[Json]  # the OpenAI paths, through the ext_proc
    passthrough_routes: list[Json]  # the engines' read-only endpoints, without it
    catch_all_route: Json  # the rest, through the ext_proc (it answers 404/405)
    every_other_route: Json  # merged into any other route of a user's Envoy
    extproc_cluster: Json
    decode_pool: Json
    prefill_pool: Json
    prefill_listener: Json
    eds_access_log_cluster: Json | None = None  # extproc.eds_access_log; None: via extproc

    @property
    def ingress_routes(self) -> list[Json]:
        """The ingress virtual host's routes, in match order."""
        return [*self.llm_routes, *self.passthrough_routes, self.catch_all_route]

    @property
    def clusters(self) -> list[Json]:
        own = [self.eds_access_log_cluster] if self.eds_access_log_cluster else []
        return [self.extproc_cluster, *own, self.decode_pool, self.prefill_pool]


def envoy_pieces(
    cfg: Config, extproc_address: str, prefill_listen: str, eds_access_log: str | None = None
) -> EnvoyPieces:
    """The pieces for `cfg`, with the ext_proc at `extproc_address` and the prefill listener on
    `prefill_listen`. The pools' members come from the ext_proc over EDS
    (`extproc.membership.eds`), at `extproc_address` or, when given, at `eds_access_log`
    with the access log."""
    feeds = EXTPROC_CLUSTER if eds_access_log is None else EDS_ACCESS_LOG_CLUSTER
    return EnvoyPieces(
        ingress_hcm_settings=ingress_hcm_settings(cfg, feeds),
        ext_proc_filter=ext_proc_filter(cfg),
        llm_routes=llm_routes(cfg),
        passthrough_routes=passthrough_routes(),
        catch_all_route=catch_all_route(cfg),
        every_other_route=without_extproc(),
        extproc_cluster=extproc_cluster(extproc_address, cfg),
        decode_pool=pool_cluster(pool_cluster_name(Role.DECODE), cfg, feeds),
        prefill_pool=pool_cluster(pool_cluster_name(Role.PREFILL), cfg, feeds),
        prefill_listener=prefill_listener(cfg, prefill_listen),
        eds_access_log_cluster=(
            None if eds_access_log is None else eds_access_log_cluster(eds_access_log, cfg)
        ),
    )
