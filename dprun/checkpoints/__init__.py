"""`dprun ckpt`: a --save-dir listed and verified, and its steps exported in torch's own
formats.
"""
