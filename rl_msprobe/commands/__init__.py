"""Thin click commands, one module per area; the library does the work."""
