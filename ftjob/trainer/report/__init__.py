"""What the trainer tells while it runs: progress, Prometheus metrics, trackers."""
