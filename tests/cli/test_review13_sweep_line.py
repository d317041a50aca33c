"""Review 13: a sweep's last line counts an interrupted job as interrupted, not failed (its row
names the checkpoint and the command that continues it)."""

from __future__ import annotations

import autobatch.__main__ as entry
import autobatch.cli.sweep as sweep


def test_the_sweep_line_tells_interrupted_jobs_from_failed_ones(tmp_path, monkeypatch, capsys):
    (tmp_path / "summary.md").write_text("| job |\n")
    rows = [{"status": "ok"}, {"status": "failed"}, {"status": "interrupted"}]
    monkeypatch.setattr(sweep, "last_sweep_dir", lambda: tmp_path)
    monkeypatch.setattr(sweep, "write_summary", lambda directory, plot: rows)
    entry._report_sweep()
    assert "3 jobs, 1 failed, 1 interrupted (their rows say how to continue); summary:" in capsys.readouterr().out
