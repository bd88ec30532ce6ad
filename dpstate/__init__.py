"""dpstate: the worker library of DeadPool (torch lives here).

    model = build(dpstate.local_device())  # before init(): a spare builds it while it waits
    opt = dpstate.AdamW(model.parameters())  # torch's AdamW; its steps land in the snapshot buffers (no copy)
    job = dpstate.init(); ddp = job.data_parallel(model); job.track(model=model, optimizer=opt, data=sampler)
    for step in job.steps(total):
        with step: ...   # failures caused by a reconfiguration are swallowed and the loop recovers
"""

from .steps.abort import ABORT_MARKER, Aborted, AbortSignal, classify
from .groups.ddp import DataParallel
from .groups.pgroup import local_device
from .replication.replicator import ReplicationError
from .steps.joining import init
from .snapshot.optim import AdamW
from .groups.parallel import Parts, StalePartsError
from .steps.session import Job, Step
from .snapshot.packing import SnapshotError

__all__ = [
    "ABORT_MARKER",
    "AbortSignal",
    "AdamW",
    "Aborted",
    "DataParallel",
    "Job",
    "Parts",
    "ReplicationError",
    "SnapshotError",
    "StalePartsError",
    "Step",
    "classify",
    "init",
    "local_device",
]
