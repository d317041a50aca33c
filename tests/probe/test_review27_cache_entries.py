"""Hand-edited or damaged cache entries, reviewed: an entry whose answer could not be this
probe's (above its ``max_batch``, not a multiple of its ``multiple_of``), or whose trials the
report cannot show (a trial's ``seconds`` or ``steps`` that is text), was served as the answer;
``cache=""`` cached in the working directory."""

import json

import pytest

from autobatch import cache as probe_cache
from autobatch import find_max_batch

from workloads import ThresholdStep


def _probe(directory, **options):
    return find_max_batch(ThresholdStep(100), cache_key="review27", steps_per_trial=1, cache=directory, **options)


@pytest.mark.parametrize("edit", [
    {"batch_size": 10**6},                      # above max_batch=512: never this probe's answer
    {"batch_size": 99},                         # not a multiple of multiple_of=4
    {"trials": [{"batch_size": 100, "passed": True, "peak_bytes": None, "seconds": "0.1", "steps": 1}]},
    {"trials": [{"batch_size": 100, "passed": True, "peak_bytes": None, "seconds": 0.1, "steps": "3"}]},
])
def test_an_entry_that_is_not_this_probes_answer_is_a_miss(tmp_path, edit):
    first = _probe(tmp_path, max_batch=512, multiple_of=4)
    assert not first.cached and first.batch_size == 100
    path = next(tmp_path.glob("*.json"))
    entry = json.loads(path.read_text())
    entry["result"].update(edit)
    path.write_text(json.dumps(entry))
    probe_cache._warned.clear()
    again = _probe(tmp_path, max_batch=512, multiple_of=4)
    assert not again.cached and again.batch_size == 100
    assert _probe(tmp_path, max_batch=512, multiple_of=4).cached  # the probe rewrote it


@pytest.mark.parametrize("directory", ["", "  "])
def test_an_empty_cache_directory_is_refused(tmp_path, monkeypatch, directory):
    """``cache=""`` (an unset setting) named the working directory: entries and a lock file
    were written beside the user's files, and ``clear("")`` deleted entries there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cache=True"):
        _probe(directory)
    with pytest.raises(ValueError, match="names no directory"):
        probe_cache.clear(directory)
    assert list(tmp_path.iterdir()) == []
