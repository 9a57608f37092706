"""The trainer's data: records, tokenize, pairs, prepare (once, on the volume) and batches;
what they read is fetched first (trainer/fetch)."""
