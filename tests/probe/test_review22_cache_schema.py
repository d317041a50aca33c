"""An entry an older autobatch wrote (another entry format) is skipped with a warning that says
what wrote it and how to be rid of it, not only which schema numbers differ."""

import json
import logging

from autobatch import cache as probe_cache


def test_an_older_entry_says_how_to_clear_it(tmp_path, caplog):
    path = tmp_path / f"{'a' * 64}.json"
    path.write_text(json.dumps({"schema": 0, "kind": "autobatch.probe-result", "key": "a" * 64}))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert probe_cache.list_entries(tmp_path) == []
    assert "written by an older autobatch" in caplog.text and f"cache clear --dir {tmp_path}" in caplog.text
    assert probe_cache.clear(tmp_path) == 1 and not path.exists()
