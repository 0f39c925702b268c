"""Device and numerics checks with JSON results."""
