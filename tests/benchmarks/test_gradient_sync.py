"""hsd bench gradsync through the CLI: two real gloo ranks, both ways of summing, every row reported."""

import json

from hsd_testing import hsd


def test_bench_gradsync_json():
    proc = hsd("bench", "gradsync", "--hidden", "16", "32", "--layers", "1", "--reps", "1", "--json", timeout=180)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and [r["hidden"] for r in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert row["tensors"] == 2 + 11 and row["per_tensor_ms"] > 0 and row["bucketed_ms"] > 0
        # two ranks: each element is one float32 addition, whichever way it is summed
        assert (row["ways_differ_by"], row["sum_error"]) == (0.0, 0.0), row
    assert hsd("bench", "gradsync", "--layers", "0", check=False).returncode != 0
