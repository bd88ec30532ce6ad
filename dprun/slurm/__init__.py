"""Slurm: the rendezvous an `srun` step implies, and settling a job that lost its controller
with the batch script's node.
"""
