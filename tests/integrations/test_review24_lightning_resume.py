"""Review 24: resuming with ``fit(ckpt_path=...)`` from a checkpoint saved without
``AutoBatchSize`` (a run from before the callback was added, or one Lightning's
``BatchSizeFinder`` sized). Lightning holds the loaded checkpoint (weights and Adam moments)
through ``on_fit_start`` in host memory, which a GPU's probe does not count; the simulated
device, where the CPU is the device, counted it: under 2 MiB no batch fitted
(``NoBatchFitsError`` at batch 1) where the same resume without the callback trains at 200. It
is now outside the simulated budget while the callback probes, as on a GPU, and put back for
Lightning to restore the optimizers from (``tests/gpu/test_cuda_lightning.py`` checks the GPU)."""

from __future__ import annotations

import pytest

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, Tiny, trainer  # noqa: E402


def test_a_run_resumed_from_a_checkpoint_without_the_callback_is_probed_beside_what_fit_trains_with(tmp_path):
    path = tmp_path / "before.ckpt"
    with simulated_memory(BUDGET):
        first = trainer()
        first.fit(Tiny(batch_size=4))
        first.save_checkpoint(path)
    module, callback = Tiny(batch_size=4), AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False)
    resumed = trainer(callback)
    resumed.fit_loop.epoch_loop.max_steps = 6
    with simulated_memory(BUDGET):
        resumed.fit(module, ckpt_path=path)  # NoBatchFitsError at batch 1 before
    assert callback.batch_size == 32 and module.seen == [32, 32]  # trained from step 4 to 6 at the size set
    state = resumed.optimizers[0].state_dict()["state"]
    assert state and all(int(moments["step"]) == 6 for moments in state.values())  # the checkpoint's moments restored
