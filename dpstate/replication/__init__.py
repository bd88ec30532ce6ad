"""Replication and restore: snapshots sent to replica holders and acked, fetched back,
their sources, a stopping job's own copies, and where the time goes.
"""
