"""Who is in the pools: discovery sources, Kubernetes watches, and EDS for Envoy."""
