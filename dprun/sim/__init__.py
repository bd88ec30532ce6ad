"""Deterministic simulation of the controller under random fault schedules (see runner.run_schedule)."""
