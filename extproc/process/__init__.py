"""The processes and their servers: the sidecar, Envoy, workers, gRPC services, TLS."""
