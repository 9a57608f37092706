"""The ranks together: preflight, heartbeats, stragglers, and the termination record the node's
agent reads."""
