"""Review 36: the probe cache as users of a shared cluster meet it (a hit's summary, a cache
directory that cannot be written)."""

import logging

from autobatch import cache as probe_cache
from autobatch import find_max_batch

from workloads import ThresholdStep


def test_review36_a_hit_says_from_when_and_what_the_stored_probe_took(tmp_path):
    """A hit's summary said "cached" and the look-up's 0.01 s, never when the answer was stored
    (a week-old entry looked like a fresh one) nor what the probe it saves had taken."""
    first = find_max_batch(ThresholdStep(100), cache=tmp_path, cache_key="review36", strategy="binary", max_batch=256)
    (entry,) = probe_cache.list_entries(tmp_path)
    second = find_max_batch(ThresholdStep(100), cache=tmp_path, cache_key="review36", strategy="binary", max_batch=256)
    assert second.cached and second.batch_size == first.batch_size == 100
    note = f"stored {entry.created} by a probe of {first.elapsed_s:.2f} s"
    assert note in second.summary() and str(entry.path) in second.summary()


def test_review36_an_unlockable_cache_directory_names_the_settings(tmp_path, caplog):
    """A default cache under a read-only home said "choose a writable cache directory" without
    naming how; the entry-write warning named $AUTOBATCH_CACHE_DIR, cache=path and cache=False."""
    result = find_max_batch(ThresholdStep(10), cache=False, strategy="binary", max_batch=16)
    (tmp_path / "file").write_text("x")
    probe_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert probe_cache.ProbeCache(tmp_path / "file").put("a" * 64, {}, result) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "not cached" in warning and "$AUTOBATCH_CACHE_DIR, cache=path, or cache=False" in warning, warning
