"""LibCST codemods, one module per upstream file; each is a pure `str -> str` edit."""
