"""`dilocod bench loopback` end to end (what `make demo` runs until the demo exists): real
processes, a small fragment, and the JSON a person or a script reads afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

RUN_TIMEOUT_S = 180
COMMAND = "bench loopback --size 4MiB --streams 1,2 --codec none,lz4 --repeats 1 --json -"


def test_loopback_bench_reports_every_combination() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dilocod", *COMMAND.split()],
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert [r["streams"] for r in result["raw"]] == [1, 2]
    assert all(r["gbps"] > 0 and r["one_thread_gbps"] > 0 for r in result["raw"])
    rows = {(r["codec"], r["streams"], r["checksums"]) for r in result["runs"]}
    assert rows == {
        (codec, streams, checksums)
        for streams in (1, 2)
        for codec, checksums in [("none", "while sending"), ("none", "prepared"), ("lz4", "while sending")]
    }
    for row in result["runs"]:
        assert row["gbps"] > 0
        assert row["ratio_to_raw"] > 0 and row["ratio_to_one_thread_raw"] > 0
        if row["codec"] == "none":  # uncompressed chunks cost only their headers on the wire
            assert 0.99 < row["compression_ratio"] < 1.0
    assert all(row["prepare_ms"] >= 0 for row in result["runs"] if row["checksums"] == "prepared")
    assert "raw TCP x2" in done.stderr.decode()
