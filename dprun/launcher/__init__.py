"""The launcher: the controller's I/O shell, one job on this machine, the node agents it starts
and the options of `dprun run`, parsed and checked.
"""
