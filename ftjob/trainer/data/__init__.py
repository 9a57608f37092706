"""The trainer's data: sources (downloads), records, tokenize, pairs, prepare (once, on the
volume) and batches."""
