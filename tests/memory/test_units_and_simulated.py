"""Byte parsing and the simulated memory-capped device."""

import gc

import pytest
import torch

from autobatch import format_bytes, parse_bytes, simulated_memory
from autobatch.memory.simulated import active_simulation


@pytest.mark.parametrize(
    "text, expected",
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("1000", 1000),
     (4096, 4096), ("64 KiB", 65536), ("1tib", 2**40), ("3e3", 3000)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "", "-5MiB", 0, -1, True, None, [1]])
def test_parse_bytes_rejects_with_the_argument_name(bad):
    with pytest.raises(ValueError, match="memory_limit"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(None) == "-"


def test_counts_allocations_and_gives_them_back_when_tensors_die():
    with simulated_memory("64MiB") as device:
        assert device.current_bytes == 0
        x = torch.zeros(1024, 1024)  # 4 MiB
        assert device.current_bytes == 4 * 2**20
        view = x.view(-1)  # a view allocates nothing
        y = x + 1  # 4 MiB more
        assert device.current_bytes == 8 * 2**20
        x.add_(1)  # in place: nothing new
        assert device.current_bytes == 8 * 2**20
        del x
        assert device.current_bytes == 8 * 2**20  # the view keeps the storage alive
        del view, y
        gc.collect()
        assert device.current_bytes == 0
        assert device.peak_bytes == 8 * 2**20


def test_allocation_past_the_budget_raises_out_of_memory_and_is_not_counted():
    with simulated_memory("10MiB") as device:
        keep = torch.zeros(2 * 2**20)  # 8 MiB
        with pytest.raises(torch.OutOfMemoryError, match="Simulated out of memory"):
            torch.ones(2**20)  # 4 MiB more would pass 10 MiB
        assert device.current_bytes == 8 * 2**20
        assert device.peak_bytes == 8 * 2**20
        assert device.oom_count == 1
        del keep


def test_backward_and_optimizer_allocations_count():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    with simulated_memory("1GiB") as device:
        model(torch.randn(32, 256)).sum().backward()
        after_backward = device.current_bytes
        assert after_backward >= 256 * 256 * 4  # the weight gradient
        opt.step()
        assert device.current_bytes >= after_backward + 2 * 256 * 256 * 4  # Adam's two moments


def test_preexisting_tensors_do_not_count_even_when_updated_in_place():
    params = torch.zeros(2**20)
    with simulated_memory("1MiB") as device:
        params.add_(1)
        torch._foreach_add_([params], 1.0)
        assert device.current_bytes == 0


def test_contexts_nest_and_the_innermost_is_active():
    with simulated_memory("100MiB") as outer:
        assert active_simulation() is outer
        with simulated_memory("4MiB") as inner:
            assert active_simulation() is inner
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(2 * 2**20)  # 8 MiB fits the outer budget only
            x = torch.zeros(2**19)  # 2 MiB counts in both
            assert inner.current_bytes == outer.current_bytes == 2 * 2**20
        assert active_simulation() is outer
        del x
    assert active_simulation() is None


def test_outside_the_context_nothing_is_counted():
    with simulated_memory("1MiB") as device:
        pass
    torch.zeros(2**20)
    assert device.current_bytes == 0
