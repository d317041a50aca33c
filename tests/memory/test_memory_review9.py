"""Review 9 of the simulated device's accounting: a storage dying in a garbage collection that
runs while the accountant holds its lock, and storages that start empty and grow."""

import gc
import subprocess
import sys

import pytest
import torch

from autobatch import simulated_memory
from conftest import cli_env

#: tensors freed by a garbage collection that runs inside the accountant's locked section (gc
#: runs at an allocation, and ``weakref.finalize`` allocates there): their finalizers re-enter
DYING_IN_A_COLLECTION = """
import gc, torch
from autobatch import simulated_memory

class Cycle:  # a tensor reachable only through a reference cycle: freed by a collection
    def __init__(self, tensor):
        self.tensor, self.me = tensor, self

with simulated_memory("64MiB") as device:
    for threshold in range(2, 30):  # the old lock hung by threshold 20 at 100 tensors each
        gc.collect()
        gc.set_threshold(threshold, 1000, 1000)
        try:
            for _ in range(150):
                Cycle(torch.empty(16))
                kept = torch.empty(16)
        finally:
            gc.set_threshold(700, 10, 10)
    del kept
    gc.collect()
    print("done", device.current_bytes)
"""


def test_a_storage_freed_by_a_collection_inside_the_accounting_does_not_deadlock(tmp_path):
    """A collection that frees a counted storage while an operator's outputs are being counted
    (an exception's traceback cycle holding activations, say) ran the storage's release, which
    waited for the lock its own thread held: the process hung for good."""
    try:
        done = subprocess.run([sys.executable, "-c", DYING_IN_A_COLLECTION], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the simulated device deadlocked: a storage's release waited for its own thread's lock")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["done", "0"]


def test_the_accounting_lock_can_be_taken_again_by_its_own_thread():
    with simulated_memory("1MiB") as device:
        with device._lock:
            assert device._lock.acquire(timeout=1), "a release inside the locked section would deadlock"
            device._lock.release()


def test_a_storage_that_starts_empty_counts_when_it_grows():
    """``torch.empty(0)`` allocates nothing, so it was never tracked, and what it grew to later
    (``resize_``, an ``out=`` argument) was never counted: a loop filling such buffers used
    memory the budget never saw."""
    with simulated_memory("1MiB") as device:
        grown = torch.empty(0)
        grown.resize_(1000)
        assert device.current_bytes == 4000
        out = torch.empty(0)
        torch.cat([torch.ones(250)] * 4, out=out)  # 1000 floats into ``out``; the ones die
        gc.collect()
        assert device.current_bytes == 8000
        del grown, out
        gc.collect()
        assert device.current_bytes == 0


def test_an_empty_storage_growing_past_the_budget_is_out_of_memory():
    with simulated_memory("64KiB") as device:
        buffer = torch.empty(0)
        try:
            buffer.resize_(2**20)
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("growing to 4 MiB under a 64 KiB budget did not run out of memory")
        assert device.oom_count == 1


def _in_thread(target):
    """Run ``target`` in a new thread; what it returned or raised."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = target()
        except Exception as error:  # noqa: BLE001 - handed back to the test
            outcome["value"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    return outcome.get("value")


def test_a_block_open_in_another_thread_is_not_this_threads_budget():
    """The active budgets were one list for the process: a probe in one thread took a block
    another thread had open for its own (and refused a ``memory_limit`` of another size "inside"
    it), though that block counts nothing in this thread."""
    import threading

    import autobatch
    from autobatch.memory.simulated import active_simulation

    opened, close = threading.Event(), threading.Event()

    def hold():
        with simulated_memory("1MiB"):
            opened.set()
            close.wait(timeout=120)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(timeout=60)
        assert active_simulation() is None
        assert _in_thread(active_simulation) is None

        def probe():
            return autobatch.find_max_batch(lambda b: torch.empty(b, 1024), memory_limit="2MiB", strategy="binary",
                                            max_batch=4096, cache=False).batch_size

        found = probe()
        assert found <= 512, found  # 2 MiB holds 512 rows of 4 KiB at most
        assert _in_thread(probe) == found
    finally:
        close.set()
        holder.join()


def test_host_memory_in_another_thread_leaves_this_threads_budget_counting():
    """``host_memory()`` paused every active budget of the process: while another thread staged
    host copies, this thread's allocations went uncounted."""
    import threading

    from autobatch.memory.simulated import host_memory

    staging, done = threading.Event(), threading.Event()

    def stage():
        with host_memory():
            staging.set()
            done.wait(timeout=120)

    with simulated_memory("1MiB") as device:
        stager = threading.Thread(target=stage)
        stager.start()
        try:
            assert staging.wait(timeout=60)
            kept = torch.empty(1000)
            assert device.current_bytes == 4000
        finally:
            done.set()
            stager.join()
        del kept



@pytest.mark.parametrize("count, expected", [
    (2**20 - 1, "1.00 MiB"), (1023.7, "1.00 KiB"), (2**30 - 2**10, "1.00 GiB"), (2**40 - 1, "1.00 TiB"),
    (1023, "1023 B"), (1024 * 1023, "1023.00 KiB"), (-(2**20 - 1), "-1.00 MiB"),
])
def test_a_count_that_rounds_up_to_the_next_unit_is_written_in_it(count, expected):
    """``format_bytes(2**20 - 1)`` said "1024.00 KiB": the unit was chosen before rounding."""
    from autobatch import format_bytes

    assert format_bytes(count) == expected


def test_a_memory_limit_of_the_blocks_own_size_probes_the_block():
    """Inside ``simulated_memory("1MiB")``, ``memory_limit="1MiB"`` opened a second 1 MiB budget
    inside the block, blind to the 512 KiB the block already held: the probe planned for 1 MiB
    free, ran out of memory on the way (11 trials, 5 OOMs where the block itself took 4 and 1),
    and reported a peak without the block's bytes."""
    import autobatch

    def step(batch_size):
        torch.empty(batch_size, 1024)

    with simulated_memory("1MiB"):
        held = torch.empty(128, 1024)  # 512 KiB of the block in use
        plain = autobatch.find_max_batch(step, strategy="auto", max_batch=4096, cache=False)
        named = autobatch.find_max_batch(step, memory_limit="1MiB", strategy="auto", max_batch=4096, cache=False)
        del held
    assert named.batch_size == plain.batch_size == 128
    assert (named.num_trials, named.num_ooms) == (plain.num_trials, plain.num_ooms)
    assert named.peak_bytes == plain.peak_bytes == 2**20


def test_a_negative_quantity_is_said_to_be_negative():
    from autobatch.memory.units import parse_bytes

    for value in ("-1GiB", " -512 MiB", "-3"):
        with pytest.raises(ValueError, match="memory_limit must be positive"):
            parse_bytes(value)
    with pytest.raises(ValueError, match="is not a byte quantity"):
        parse_bytes("-lots")


def test_the_default_cpu_budget_does_not_drift_with_free_memory(monkeypatch):
    """The probe cache keys on the budget: a budget that followed free RAM byte for byte missed
    the cache on every run of a machine with under 8 GiB free."""
    import os

    from autobatch.memory.devices import default_cpu_budget

    def budget_with(free: int) -> int:
        monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": free // 4096, "SC_PAGE_SIZE": 4096}[name])
        return default_cpu_budget()

    assert budget_with(5 * 2**30) == budget_with(5 * 2**30 + 300 * 2**20) == 5 * 2**30 // 4 // 2**28 * 2**28
    assert budget_with(64 * 2**30) == 2 * 2**30  # at most 2 GiB
    assert budget_with(100 * 2**20) == 64 * 2**20  # at least 64 MiB


def test_an_mps_oom_message_is_read_in_powers_of_1024():
    """The MPS allocator labels powers of 1024 "MB" and "GB": read as decimal they were 5 % low."""
    from autobatch.memory.oom import requested_bytes

    mps = ("MPS backend out of memory (MPS allocated: 1.80 GB, other allocations: 2.10 MB, max allowed: "
           "18.13 GB). Tried to allocate 256.00 MB on private pool.")
    assert requested_bytes(mps) == 256 * 2**20
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB.") == 2 * 2**30
    assert requested_bytes("XPU out of memory. Tried to allocate 3.00 MB") == 3 * 10**6  # no MPS: as written
