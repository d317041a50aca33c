"""``fit(resume=True)`` (a flag, as other trainers take) was pathlib's bare ``TypeError: expected
str, bytes or os.PathLike object, not bool`` from deep in the resume code; it says what to pass."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner


@pytest.mark.parametrize("resume", [True, False])
def test_a_resume_that_is_no_path_says_what_to_pass(tmp_path, resume):
    model = torch.nn.Linear(2, 1)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), global_batch=2,
                    device="cpu", checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(TypeError, match=rf"resume={resume!r} is no checkpoint: .*checkpoint_dir \(resume='{tmp_path}'\)"):
        runner.fit([torch.randn(2, 2)], resume=resume)
