"""What outlives a process: checkpoints, their integrity, the volume's errors, the export and
its push."""
