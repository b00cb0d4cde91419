"""canaries."""
