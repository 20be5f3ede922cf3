"""Paged attention over the KV pool: the torch backend (`torch_backend`, CPU and fallback GPU), flashinfer's
(`flashinfer_backend`), the CPU decode kernel in C (`cpu_kernel`) and the CPU decode staging it reads."""
