"""Live accounting of what decoding costs: KV and drafter-state memory (memory.py)."""
