"""Events as a controller publishes them, for tests of what is made of them (the dashboard's view model, the
report): a hot-swapped job's whole stream, its clock starting at T0."""

from __future__ import annotations

T0 = 1_000_000.0


def hot_swap_events() -> list[dict]:
    """2 nodes + 1 spare; node1 dies after step 20; the spare takes over from step 19; 40 steps in all."""
    ev = [
        {"event": "node_joined", "time": T0 + 0.1, "node": "node0", "host": "h0", "role": "active", "pid": 100},
        {"event": "node_joined", "time": T0 + 0.1, "node": "node1", "host": "h1", "role": "active", "pid": 101},
        {"event": "node_joined", "time": T0 + 0.2, "node": "node2", "host": "h2", "role": "spare", "pid": 102},
        {"event": "job_started", "time": T0 + 0.3, "generation": 0, "nnodes": 2, "world_size": 4, "spares": 1,
         "layout": ["node0", "node1"]},
    ]
    ev += [{"event": "progress", "time": T0 + 10 + s, "generation": 0, "step": s, "loss": 5.0 - s / 10,
            "tokens": 1024} for s in range(1, 21)]  # 1 step/s, steps 1..20 at t = 11..30
    ev += [
        {"event": "fault_injected", "time": T0 + 30.5, "node": "node1", "node_rank": 1, "kind": "kill-node",
         "spec": "kill-node:1@step=20"},
        {"event": "node_failed", "time": T0 + 30.6, "node": "node1", "node_rank": 1, "role": "active",
         "cause": "agent process exited (killed by SIGKILL)"},
        {"event": "spare_promoted", "time": T0 + 30.6, "spare": "node2", "node_rank": 1, "generation": 1},
        {"event": "reconfigure", "time": T0 + 30.6, "generation": 1, "restore_step": 19,
         "layout": ["node0", "node2"], "decide_s": 0.002},
        {"event": "progress", "time": T0 + 32.5, "generation": 1, "step": 20, "loss": 3.0, "tokens": 1024},
        {"event": "recovery_complete", "time": T0 + 32.5, "mode": "hot-swap", "generation": 1, "restore_step": 19,
         "lost_steps": 1, "failed": ["node1"], "promoted": {"1": "node2"},
         "phases": {"detect_s": 0.1, "decide_s": 0.0, "rebuild_s": 0.3, "restore_s": 0.5, "total_s": 2.0}},
    ]
    ev += [{"event": "progress", "time": T0 + 32.5 + s - 20, "generation": 1, "step": s, "loss": 2.0,
            "tokens": 1024} for s in range(21, 41)]
    ev.append({"event": "job_finished", "time": T0 + 53.0, "exit_code": 0, "message": "all 4 ranks finished"})
    return ev
