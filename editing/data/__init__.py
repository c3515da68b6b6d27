"""Data: the built-in offline suite and its procedural renderer."""
