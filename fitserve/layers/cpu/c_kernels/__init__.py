"""fitserve's compiled CPU kernels (C, built on first use for the machine; see library.py)."""
