"""What a job trains for: each objective, its loss and its metrics."""
