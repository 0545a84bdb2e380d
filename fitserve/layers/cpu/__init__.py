"""The CPU's own forms of the layers: weight formats (int4 with fitserve's C kernel or torch's, a float16
copy for fbgemm), the float32 RMSNorm, and `c_kernels/`, fitserve's C kernels for x86-64 CPUs
with AVX-512 or AVX2 + FMA (library.py picks the set).
The layers in fitserve/layers/ pick them on the CPU; the CPU attention backend is
fitserve/layers/attention/cpu_backend.py."""
