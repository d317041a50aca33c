"""What a user runs from the docs as printed: the reports page's example is a whole program, and
the CPU smoke run of the planner's benchmark does not fail on timing noise.

``test_review20_docs_snippets.py`` executes the planning and runner pages' first blocks, which
leave their inputs (``step``, ``loader``) to the reader; the reports page's block is meant to be
copied whole (it read ``step`` and ``rows`` no line made, and ``pd`` no line imported), so here
every name it reads must be made by it. Running it takes seconds (a probe and a timed plan), so
it is checked statically. What the pages show a command print (a probe table) or an object hold (a
decorator's attempts) is compared with what the code prints and holds.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re

from conftest import REPO


def _unbound_names(code: str) -> set[str]:
    """Names ``code`` reads that no line of it binds (imports, assignments, arguments, defs)."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return read - bound


def test_review32_reports_example_is_a_whole_program():
    text = (REPO / "docs" / "reports.md").read_text()
    code = re.search(r"^```python\n(.*?)^```", text, re.S | re.M).group(1)
    assert not _unbound_names(code), f"docs/reports.md's example reads names it never makes: {_unbound_names(code)}"
    assert "simulated_memory" in code  # it runs on a CPU in seconds, as printed


def test_review32_bench_plan_cpu_timings_not_judged():
    spec = importlib.util.spec_from_file_location("bench_plan_review32", REPO / "scripts" / "bench_plan.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # the CPU smoke run's toy model re-timed at 95.8 % of the best in one run and 100 % in the next
    assert bench.verdict(0.958, "cpu") == ("not judged on the CPU (a check that the script runs)", True)
    assert bench.verdict(0.958, "cuda") == ("FAIL: within 3%", False)
    assert bench.verdict(0.99, "cuda") == ("PASS: within 3%", True)


def _printed_probe_tables():
    """Each probe table the README or a docs page prints (a ```text/```console block holding a ``trials`` line)."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"^```(?:text|console)\n(.*?)^```", page.read_text(), re.S | re.M):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                if line.startswith("trials    ") and i and lines[i - 1].startswith("strategy "):
                    yield page.name, lines[i - 2:i + 5]


def test_review36_printed_probe_tables_are_summarys():
    """A probe table the docs print (the command line's output) reads as ``ProbeResult.summary()``
    prints it: docs/cli.md showed ``trials          9 (4 OOM)`` after the line had become
    ``9 trials (4 OOM)``. Each table's figures are rebuilt into a result and its lines compared."""
    from autobatch import ProbeResult, TrialRecord

    tables = list(_printed_probe_tables())
    assert tables, "no printed probe table found in docs/"
    for page, table in tables:
        value = {line[:16].strip(): line[16:] for line in table}
        count, ooms = map(int, re.search(r"(\d+)\D+(\d+) OOM", value["trials"]).groups())
        strategy, _, used = value["strategy"].partition(" -> ")
        size = int(value["batch size"])
        trials = [TrialRecord(size + 1, False, 0, 0.1)] * ooms + [TrialRecord(size, True, 0, 0.1)] * (count - ooms)
        result = ProbeResult(batch_size=size, strategy=strategy, strategy_used=used or strategy, trials=trials,
                             capacity_bytes=None, elapsed_s=float(value.get("time", "1 s").split()[0]), margin=0.0,
                             device=value["device"])
        printed = {line[:16].strip(): line for line in result.summary().splitlines()}
        for label in ("batch size", "strategy", "trials", "device", "time"):
            wanted = next((line for line in table if line[:16].strip() == label), None)
            assert wanted is None or printed[label] == wanted, f"{page} prints {wanted!r} where summary() prints {printed[label]!r}"


def test_review36_decorator_example_lists_every_attempt_field():
    """docs/integrations.md's first example lists what each of ``train.attempts`` holds; it left out
    ``start_bytes``, ``capacity_bytes``, ``error`` and ``next_batch_size``."""
    import dataclasses

    from autobatch.integrations.decorator import Attempt

    listed = re.search(r"# every attempt: ([\w, ]+)", (REPO / "docs" / "integrations.md").read_text()).group(1)
    assert listed.split(", ") == [f.name for f in dataclasses.fields(Attempt)]


def test_review39_reports_example_prints_the_diagnostics_it_says():
    """docs/reports.md's example (on the simulated CPU device) prints the gap and the allocator
    retries; its comment said ``None`` where it printed ``0 None`` (the simulated device reserves
    what it allocates: a gap of 0 B)."""
    import torch

    from autobatch.memory.devices import memory_for
    from autobatch.memory.diagnostics import memory_diagnostics

    text = (REPO / "docs" / "reports.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith('print(result.diagnostics["fragmentation_gap'))
    with memory_for(torch.device("cpu"), 8 << 20) as (memory, _):
        diagnostics = memory_diagnostics(memory)
    printed = f"{diagnostics['fragmentation_gap_bytes']} {diagnostics['num_alloc_retries']}"
    assert f"# {printed}:" in line, f"docs/reports.md says {line.split('#', 1)[1]!r}; the example prints {printed!r}"
