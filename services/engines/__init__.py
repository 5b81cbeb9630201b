"""Engines llmgw ships itself (today: ``sim``, a simulated multi-node engine)."""
