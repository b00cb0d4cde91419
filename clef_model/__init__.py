"""clef_model."""
