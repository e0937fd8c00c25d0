"""convit_scale/metrics.py: metrics.jsonl's one reader after a crash."""

from convit_scale.metrics import read_records, truncate_after


def test_a_line_torn_by_a_crash_does_not_block_reading_or_resuming(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tr')
    assert [r["step"] for r in read_records(tmp_path, "train")] == [1, 2]
    truncate_after(tmp_path, 1)
    assert [r["step"] for r in read_records(tmp_path)] == [1]
