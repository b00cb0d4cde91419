"""variants."""
