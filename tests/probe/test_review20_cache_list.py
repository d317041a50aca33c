"""``python -m autobatch cache list`` on entries whose components a hand or a tool damaged."""

from autobatch.cli import cache_command
from autobatch.probe.caching.cache import ProbeCache
from autobatch.probe.result import ProbeResult

DAMAGED = [{"model": 5}, {"model": {"modules": [[]]}}, {"model": {"modules": "Net"}}, {"precision": {"autocast": 3}},
           {"model": {"modules": [["", "Net"]]}, "precision": "bf16"}]


def test_cache_list_shows_entries_whose_components_are_damaged(tmp_path, capsys):
    """The probe serves such an entry's result (the key is its file name, the components are
    only shown), but ``cache list`` failed with an ``IndexError`` or ``AttributeError`` traceback
    on it, listing nothing; it shows ``?`` for what the components do not say."""
    store = ProbeCache(tmp_path)
    result = ProbeResult(batch_size=64, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=2**25,
                         elapsed_s=0.1, margin=0.0, device="cpu")
    for number, components in enumerate(DAMAGED):
        store.put(f"{number:064x}", components, result)
    assert cache_command.main(["list", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"{len(DAMAGED)} entries")
    assert sorted(line.split()[1] for line in lines[2:]) == ["?", "?", "?", "?", "Net"]
