"""surgery."""
