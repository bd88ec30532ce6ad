"""Process groups and parallelism: each generation's groups and DeviceMesh, their severing on
an abort, the DDP proxy, and the private corners of torch.distributed.
"""
