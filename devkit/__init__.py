"""What the tests and the benchmarks share, imported by both as a package (no sys.path edits):
daemons started as real processes, scripted peers, the chaos harness and its fault proxy, the
goodput simulator, stand-ins for the device path, and what a benchmark records about its machine.

It may import dilocod; dilocod never imports it (tests/unit/test_layering.py checks both), and it
imports nothing of tests/ or bench/. Installed with the project (`pip install -e .`); nothing here
runs on import.
"""
