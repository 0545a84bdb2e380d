"""Quantized checkpoints: detection (quant_config.py), the canonical int4 form every int4 format becomes
at load (int4_weight.py), each format's unpacking (int4_formats.py), and the linear method that loads
and runs them (int4_method.py, CPU forms in int4_cpu.py). docs/quantization.md says what runs."""
