"""What users write for a byte quantity: a list or tuple (``[8, "GiB"]``, Hydra's ``[8,GiB]``)
is one error giving the string to write; Kubernetes' ``"8Gi"`` is 8 GiB; a decimal limit
(``"16m"``: 16,000,000 bytes) shown in binary units (15.26 MiB) says where the odd number came from."""

import pytest
import torch

from autobatch.memory.devices import check_limit_in_simulation
from autobatch.memory.simulated import simulated_memory
from autobatch.memory.units import parse_bytes


@pytest.mark.parametrize("value, written", [([8, "GiB"], "'8GiB'"), (["8GiB"], "'8GiB'"), ((1.5, "GB"), "'1.5GB'"),
                                            (b"512MiB", "'512MiB'")])
def test_a_list_or_bytes_names_the_string_to_write(value, written):
    told = r"(is a (list|tuple), not a byte quantity|is bytes, not a string)"
    with pytest.raises(ValueError, match=rf"{told}; write memory_limit={written}"):
        parse_bytes(value)
    with pytest.raises(ValueError, match=r"give one byte count"):
        parse_bytes([8, 8])


def test_binary_suffixes_and_the_decimal_note():
    assert parse_bytes("8Gi") == 8 * 1024**3 and parse_bytes("512 mi") == 512 * 1024**2
    assert parse_bytes("16m") == parse_bytes("16 MB") == 16_000_000  # decimal, as the docs say
    with simulated_memory("16MiB"), pytest.raises(ValueError, match=r"16,000,000 bytes: '16M' and '16MB' are powers "
                                                                  r"of 1000; '16MiB' is 16 x 1024\*\*2"):
        check_limit_in_simulation(torch.device("cpu"), parse_bytes("16m"))


def test_review37_words_for_no_limit_a_share_and_an_index_say_what_to_write():
    """``"none"`` (a config's text for no limit) read as "not a byte quantity"; ``0.5`` (half the
    device?) only as half a GiB; ``device=0`` on a machine without an accelerator as "not a torch
    device", where torch takes it as the accelerator's index."""
    import autobatch

    with pytest.raises(ValueError, match=r"'none' is a string, not 'no limit': for no limit pass None \(null"):
        autobatch.parse_bytes("none")
    with pytest.raises(ValueError, match=r"did you mean '0.5GiB'\? A share of the device is not taken"):
        autobatch.parse_bytes(0.5)
    with pytest.raises(ValueError, match=r"probe.memory_limit='80%'.*or give a size, probe.memory_limit='64GiB'"):
        autobatch.parse_bytes("80%", name="probe.memory_limit")
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match="device=0 is an accelerator's index, and this machine has no accelerator"):
            autobatch.find_executable_batch_size(lambda batch_size: batch_size, starting_batch_size=8, device=0)()
