"""The chaos harness (real daemons under a schedule of faults) and its frame-aware fault proxy:
tests/chaos/ asserts on its reports, bench/chaos.py and bench/reconnects.py record them."""
