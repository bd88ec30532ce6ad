"""The control write of saving.py: a plain write of a save's bytes at nice 19 in a scheduling group of its own,
niced too, so that it yields to training as a node's save thread does (past the page cache if DIRECT is 1, as the
saves write by default). Prints {"seconds": ...}.

Linux shares CPU between sessions' groups (autogroup) before it weighs the threads within one by nice. A node's save
thread at nice 19 shares its agent's group with that node's workers and waits for them; a writer thread at nice 19
in the benchmark's own group would get a group's whole share beside the nodes' groups (measured: a third of the
cores, 1.5-2x the save's bandwidth for the same writes, which it then made look slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plain_write import plain_write  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: _aside_write.py FOLDER NBYTES WRITERS DIRECT(0|1) (run by saving.py in a session of its own)",
              file=sys.stderr)
        return 2
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass  # (a kernel without autogroup: every thread is weighed by its nice alone, as the save thread is)
    print(json.dumps({"seconds": plain_write(Path(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1", nice=19)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
