"""Clients for the Triton `llm` model."""
