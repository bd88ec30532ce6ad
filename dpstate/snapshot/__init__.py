"""Snapshots: what one holds and how it is captured and restored, its flat format and checks,
the buffers it lives in, and a spare's preparation.
"""
