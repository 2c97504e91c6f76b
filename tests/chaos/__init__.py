"""Chaos tests: real daemons under a schedule of faults, injected through a frame-aware proxy and signals."""
