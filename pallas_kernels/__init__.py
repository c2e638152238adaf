"""Pallas kernels for jaxspec's hot paths. Self-contained: nothing here imports jaxspec."""
