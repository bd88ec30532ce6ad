"""dpagent: the node agent of DeadPool (`python -m dpagent`): its loop, its workers, its replica
server, shutdown and restart mode.
"""
