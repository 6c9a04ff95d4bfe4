"""Serving: continuous batching over decode slots (scheduler.py) and the OpenAI-compatible HTTP
server on top of it (http.py). Only http.py knows about HTTP."""
