"""Hand-written Pallas kernels for the hot spots of speculative decoding (imports only jax and numpy)."""
