"""Events as a controller publishes them for a job that shrinks and grows back (--on-spare-exhausted shrink), in
the shapes test_controller_shrink's controller publishes; their clock starts at T0 (helpers.events)."""

from __future__ import annotations

from helpers.events import T0


def shrink_and_grow_events() -> list[dict]:
    """3 nodes (one rank each), no spare; b dies after step 12: a trains ranks 0 and 1, c rank 2 from step 12
    (2.2 s from detection to the first narrow step), 2 s a step; d joins after step 25 and takes rank 1 back (2.1 s
    from its joining to the first full-width step, 1.5 s of it from the grow planned); 40 steps in all."""
    ev: list[dict] = [{"event": "node_joined", "time": T0 + 0.1, "node": n, "host": f"h{n}", "role": "active",
                       "pid": 100 + i} for i, n in enumerate("abc")]
    ev.append({"event": "job_started", "time": T0 + 0.3, "generation": 0, "nnodes": 3, "world_size": 3,
               "spares": 0, "layout": ["a", "b", "c"]})
    ev += [{"event": "progress", "time": T0 + 10 + s, "generation": 0, "step": s, "loss": 2.0}
           for s in range(1, 13)]  # t = 11 .. 22
    ev += [
        {"event": "node_failed", "time": T0 + 22.5, "node": "b", "node_rank": 1, "role": "active",
         "cause": "no heartbeat for 5.0 s"},
        {"event": "job_shrunk", "time": T0 + 23.0, "generation": 1, "nodes": ["b"], "processes": 2, "ranks": 3,
         "slowdown": 2, "carried": {"0": [1]}},
        {"event": "reconfigure", "time": T0 + 23.0, "generation": 1, "restore_step": 12, "layout": ["a", "c"],
         "decide_s": 0.01},
        {"event": "progress", "time": T0 + 25.2, "generation": 1, "step": 13, "loss": 2.0},
        {"event": "recovery_complete", "time": T0 + 25.2, "mode": "hot-swap", "generation": 1, "restore_step": 12,
         "lost_steps": 0, "failed": ["b"], "promoted": {},
         "phases": {"detect_s": 0.5, "decide_s": 0.01, "rebuild_s": 0.3, "restore_s": 0.6, "total_s": 2.7}},
    ]
    ev += [{"event": "progress", "time": T0 + 25.2 + 2 * (s - 13), "generation": 1, "step": s, "loss": 2.0}
           for s in range(14, 26)]  # step 25 at t = 49.2
    ev += [
        {"event": "node_joined", "time": T0 + 49.5, "node": "d", "host": "hd", "role": "spare", "pid": 103},
        {"event": "job_grew", "time": T0 + 50.1, "generation": 2, "nodes": ["d"], "processes": 3, "ranks": 3,
         "slowdown": 1},
        {"event": "reconfigure", "time": T0 + 50.1, "generation": 2, "restore_step": 25, "layout": ["a", "d", "c"],
         "decide_s": 0.1},
        {"event": "progress", "time": T0 + 51.6, "generation": 2, "step": 26, "loss": 2.0},
        {"event": "recovery_complete", "time": T0 + 51.6, "mode": "hot-swap", "generation": 2, "restore_step": 25,
         "lost_steps": 0, "failed": [], "promoted": {"1": "d"},
         "phases": {"detect_s": 0.0, "decide_s": 0.1, "rebuild_s": 0.4, "restore_s": 0.8, "total_s": 1.5}},
    ]
    ev += [{"event": "progress", "time": T0 + 51.6 + s - 26, "generation": 2, "step": s, "loss": 2.0}
           for s in range(27, 41)]
    ev.append({"event": "job_finished", "time": T0 + 66.0, "exit_code": 0, "message": "all 3 ranks finished"})
    return ev
