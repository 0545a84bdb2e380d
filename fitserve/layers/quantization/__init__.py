"""Quantized checkpoints: detection (quant_config.py), the canonical int4 form every int4 format becomes
at load (int4_weight.py), each format's unpacking (int4_formats.py), and the linear method that loads
and runs them (int4_method.py, CPU forms in int4_cpu.py). FP8: fp8_format.py (detection), fp8_weight.py
(the canonical Fp8Weight), fp8_method.py (loading, --quantization fp8), fp8_compute.py / fp8_block.py (the
W8A8 and weight-only forms), fp8_shapes.py (sizes). methods.py picks each layer's method by the format's
type. docs/quantization.md says what runs."""
