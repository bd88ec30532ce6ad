"""dpstate: the worker library of DeadPool (torch lives here).

    model = build(dpstate.local_device())  # before init(): a spare builds it while it waits
    opt = dpstate.AdamW(model.parameters())  # torch's AdamW; its steps land in the snapshot buffers (no copy)
    job = dpstate.init(); ddp = job.data_parallel(model); job.track(model=model, optimizer=opt, data=sampler)
    for step in job.steps(total):
        with step: ...   # failures caused by a reconfiguration are swallowed and the loop recovers
"""

from .abort import ABORT_MARKER, Aborted, AbortSignal, classify
from .ddp import DataParallel
from .pgroup import local_device
from .replication import ReplicationError
from .joining import init
from .optim import AdamW
from .parallel import Parts, StalePartsError
from .session import Job, Step
from .snapshot import SnapshotError

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
