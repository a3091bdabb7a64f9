"""``checkpoint.tag_validation`` (zero_core/checkpoint/tags.py): two ranks saving under
different tags either fail on every rank, saving nothing ("Fail"), or save one consistent
checkpoint under rank 0's tag with a warning ("Warn", DeepSpeed's default)."""
from __future__ import annotations

import os

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "tag_check.py")


def test_tags_that_differ_across_ranks(tmp_path):
    results = run_ranks(WORKER, 2, args=[tmp_path], timeout=120)
    fail = [r.report["Fail"] for r in results]
    assert all("checkpoint tags differ" in r["error"] and "'t0'" in r["error"] for r in fail)
    assert all(not any(d.startswith("t") for d in r["dirs"]) for r in fail)
    warn = sorted((r.report["Warn"] for r in results), key=lambda r: r["rank"])
    assert [r["saved"] for r in warn] == ["t0", "t0"]
    assert [r["loaded"] for r in warn] == ["t0", "t0"]
    assert all(r["warnings"] and "rank 0 't0'" in r["warnings"][0] for r in warn)
    assert "t1" not in warn[0]["dirs"]
