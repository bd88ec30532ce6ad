"""The main thread exits while the watcher thread is still inside torch's Future.set_result (a done-callback
runs there): with FutureWatcher.close at exit the process ends cleanly; without it (argument "unclosed") it
aborts ("terminate called without an active exception", exit 134)."""

import atexit
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

from dpstate.steps.watch import WATCHER  # noqa: E402

if sys.argv[2:] == ["unclosed"]:
    atexit.unregister(WATCHER.close)
backend, target = torch.futures.Future(), torch.futures.Future()
target.add_done_callback(lambda f: time.sleep(0.3))  # runs inside set_result, in the watcher thread
WATCHER.watch(backend, lambda f: target.set_result(f.value()))
backend.set_result(7)
assert target.wait() == 7  # set before the callbacks run: the main thread goes on to exit meanwhile
print("main thread done", flush=True)
