"""The Envoy configuration pd-extproc renders: named pieces, one kind per module.

`extproc.bootstrap.render` assembles them into the bootstrap and the drop-in snippet; scripts
that build other documents (an Istio EnvoyFilter, an Envoy Gateway sidecar Envoy) take the pieces by
name from `envoy_pieces`. Every function is pure and returns plain dicts (Envoy's JSON/YAML
field names). The package is not called `envoy`: that name belongs to xds-protos' modules.
"""
