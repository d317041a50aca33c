"""Review 20: interpolations on the command line, and the advice of a long out-of-memory line.

* An override holding an interpolation (``'model.width=${.layers}'``, or a key given twice, once
  as ``${oc.env:UNSET}``) crashed the command with a traceback before it ran: the command line
  recorded to rerun the job read Hydra's list of overrides element by element, which resolves
  each ``${...}`` against Hydra's own node. The overrides are now read as given.
* ``--cfg job --resolve`` with an interpolation that cannot resolve (``${oc.env:UNSET}``) was
  Hydra's traceback, exit status 1; now it is one line naming the key, exit status 2.
* "No batch size fits" ends with the allocator's message, after the advice; a long one (CUDA's)
  cut the line's middle, the advice with it (``a larger probe.memory_limit``).
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from autobatch.cli import preflight
from autobatch.cli.errors import BAD_INPUT, MAX_LINE, CLIError, describe
from autobatch.cli.user_config import command_line
from autobatch.errors import NoBatchFitsError

UNSET = "AUTOBATCH_REVIEW20_UNSET"


def test_the_recorded_command_keeps_an_overrides_interpolation_as_given(monkeypatch):
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.delenv(UNSET, raising=False)
    task = ["model=mlp", "model.width=${.layers}", f"train.lr=${{oc.env:{UNSET}}}", "train.lr=0.1"]
    node = OmegaConf.create({"overrides": {"task": task, "hydra": ["hydra.run.dir=runs/${now:%H}"]},
                             "runtime": {"config_sources": []}, "job": {"config_name": "train"}})
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: node))
    line = command_line("train")  # before: InterpolationResolutionError (a traceback, exit status 1)
    assert line == ("python -m autobatch train model=mlp 'model.width=${.layers}' 'train.lr=${oc.env:%s}' "
                    "train.lr=0.1 'hydra.run.dir=runs/${now:%%H}'" % UNSET)


def test_cfg_resolve_names_the_key_that_cannot_resolve(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    with pytest.raises(CLIError) as raised:  # before: Hydra's traceback, exit status 1
        preflight.check("probe", ["--cfg", "job", "--resolve", "model=mlp", f"probe.memory_limit=${{oc.env:{UNSET}}}"])
    assert raised.value.exit_code == BAD_INPUT
    assert raised.value.message.startswith(f"probe.memory_limit=${{oc.env:{UNSET}}}: ") and UNSET in raised.value.message


def test_what_only_hydras_run_resolves_is_left_to_it(monkeypatch):
    """``--cfg hydra``/``all`` walk Hydra's node too, where the runtime's values are not set yet."""
    monkeypatch.delenv(UNSET, raising=False)
    hydra = {"job": {"num": "???"}, "sweep": {"subdir": "${hydra.job.num}"}, "run": {"dir": "${hydra:runtime.cwd}/x"},
             "overrides": {"task": [f"seed=${{oc.env:{UNSET},0}}"]}}
    preflight._check_resolves(OmegaConf.create({"hydra": hydra, "seed": 0}))
    hydra["overrides"]["task"].append(f"seed=${{oc.env:{UNSET}}}")  # a key given twice: Hydra prints both resolved
    with pytest.raises(CLIError) as raised:
        preflight._check_resolves(OmegaConf.create({"hydra": hydra, "seed": 0}))
    assert raised.value.message.startswith(f"seed=${{oc.env:{UNSET}}}: ") and raised.value.message.endswith("give another seed")


def test_a_long_allocator_message_leaves_the_advice_in_the_line():
    cuda = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.2 GiB "
            "is free. " + "Including non-PyTorch memory, this process has 77.9 GiB memory in use. " * 5)
    exc = NoBatchFitsError(1, 2**30, 2**29, "cuda:0", last_error=cuda)
    message, _ = describe(exc)
    assert len(message) <= MAX_LINE and "a larger probe.memory_limit / device" in message and "AUTOBATCH_TRACEBACK=1" in message
    short = NoBatchFitsError(1, 2**20, 2**19, "cpu", last_error="Simulated out of memory.")
    assert describe(short)[0].endswith("Last allocator error: Simulated out of memory.")  # one that fits stays
