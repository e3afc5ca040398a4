"""Quantization: the weight schemes and their settings (``scheme``), the integer grids
(``primitives``), the quantized layer types a checkpoint becomes (``linear``: QuantLinear and
W8A8Linear), the layer-by-layer calibration scaffolding (``calibrated``), and one module per
algorithm: ``rtn``, ``gptq``, ``awq``, ``smoothquant``, ``bnb``, and the fp8 KV-cache scales
(``kv_cache``). Algorithms never import each other; they share ``scheme``, ``primitives`` and
``calibrated``.
"""
