"""Checkpoint I/O: writing the compressed-tensors export (``export``), loading a model or an
export for serving (``load``) and reading a checkpoint's layout (``inspect``). It imports no pass:
loading a checkpoint builds layer types from ``compress.quant.linear`` and nothing else.
"""
