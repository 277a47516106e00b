"""sglang."""
