"""What the engines say, watched in the background: health, probes, metrics, load, restarts."""
