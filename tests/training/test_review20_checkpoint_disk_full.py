"""A checkpoint that the disk refuses (full, a quota, a file-size limit) mid-run: ``torch.save``
swallowed the write's ``OSError`` and raised ``RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos 171456 vs 171348``, naming neither the cause nor the
file. Now the disk's own error is raised, naming ``last.pt``; the previous checkpoint stays whole,
and a second ``fit()`` goes on to the weights of a run that never failed."""

from __future__ import annotations

import errno

import pytest
import torch

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint

resource = pytest.importorskip("resource")  # POSIX: a file-size limit makes the write fail as a full disk does
signal = pytest.importorskip("signal")


def build(checkpoint_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    runner = Runner(model, torch.optim.Adam(model.parameters()), lambda m, b: (m(b[0]) - b[1]).square().mean(),
                    global_batch=4, micro_batch=2, progress=False, checkpoint_dir=checkpoint_dir, checkpoint_every=1)
    return model, runner


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs SIGXFSZ to turn a file-size limit into EFBIG")
def test_a_refused_checkpoint_write_names_the_cause_and_loses_nothing(tmp_path):
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)) for _ in range(3)]
    reference, runner = build(tmp_path / "reference")
    runner.fit(data, epochs=2)
    model, runner = build(tmp_path / "run")
    runner.fit(data, steps=2)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))  # every checkpoint is larger: step 3's fails
    try:
        with pytest.raises(OSError) as caught:
            runner.fit(data, epochs=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert caught.value.errno == errno.EFBIG and caught.value.filename == str(tmp_path / "run" / "last.pt")
    notes = " ".join(caught.value.__notes__)
    assert "was not replaced" in notes and "step 3 is trained and counted" in notes
    assert load_checkpoint(tmp_path / "run")["step"] == 2  # the previous checkpoint, whole
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["last.pt"]  # no temporary file left
    runner.fit(data, epochs=2)  # goes on from step 3, trained and counted
    assert runner.step == 6 and load_checkpoint(tmp_path / "run")["step"] == 6
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)
