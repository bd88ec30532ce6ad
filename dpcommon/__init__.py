"""dpcommon: what dprun, dpagent and dpstate share: the wire protocol and its messages, checksums,
the snapshot file format and save manifests, the replica store's rules, exit wording (no torch).
"""
