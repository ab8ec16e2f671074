"""tierstore's conformance kit (placeholder, filled below)."""
