"""Integrations with other libraries (accelerate)."""
