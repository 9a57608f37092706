"""The model: load (each rank reads its own slices: weights), attention, parallel (FSDP2)."""
