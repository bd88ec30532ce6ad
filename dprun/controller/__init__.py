"""The controller, pure: a state machine (membership, failure detection, reconstruction) and
the parts it composes; no sockets, timers or processes (the launcher's shell drives it).
"""
