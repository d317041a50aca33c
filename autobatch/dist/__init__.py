"""Many ranks: the probe and the runner under ``torch.distributed``.

* :mod:`~autobatch.dist.agreement` - the collectives with timeouts that let ranks agree
  (public as ``autobatch.distributed``);
* :mod:`~autobatch.dist.joining` - joining the launcher's process group, left at exit;
* :mod:`~autobatch.dist.probe` - every rank probes its own device in lockstep;
* :mod:`~autobatch.dist.step` - the data-parallel training step that survives an OOM on one rank;
* :mod:`~autobatch.dist.ddp_step` - the same through DDP's own reducer (bucketed all-reduce
  overlapped with backward), with the one-rank-OOM completion protocol;
* :mod:`~autobatch.dist.votes` - the vote that ends each phase of a step.
* :mod:`~autobatch.dist.leaving` - a rank whose own error no vote sees (a probe of a plain
  module or callable) tells its peers at once.
* :mod:`~autobatch.dist.timing` - the planner's timing and accumulated probe through the
  runner's step, failing on every rank together.
* :mod:`~autobatch.dist.fsdp` (with :mod:`~autobatch.dist.fsdp_guard` and
  :mod:`~autobatch.dist.fsdp_passes`) - FSDP2 (``fully_shard``) models in the probe and the
  runner, their collectives voted so that one rank's OOM never leaves another waiting in
  one; the same number of passes on every rank, and models sharded only in parts.

The probe and the runner come earlier in the pipeline and do not import this package: they
ask :mod:`autobatch.probe.ranks` and :mod:`autobatch.training.ranks`, and importing this
package installs the collective implementations there (``import autobatch`` does).
"""

from ..probe.snapshot import ddp_reducer as _ddp_reducer
from ..probe import ranks as _probe_ranks
from ..training import ranks as _training_ranks
from . import agreement
from .fsdp import FsdpDataParallel, FsdpProbeAgreement
from .fsdp_guard import reset_one_process
from .probe import CollectiveProbeAgreement
from .step import CollectiveDataParallel

# the FSDP-aware implementations hand every model that is not fully_shard-ed to the DDP ones
_probe_ranks.install(FsdpProbeAgreement())
_training_ranks.install(FsdpDataParallel(CollectiveDataParallel()))
# a one-process fully_shard model is put back after a failed step as a one-process DDP is
_ddp_reducer.add_reset(reset_one_process)

__all__ = ["agreement", "CollectiveProbeAgreement", "CollectiveDataParallel", "FsdpProbeAgreement", "FsdpDataParallel"]
