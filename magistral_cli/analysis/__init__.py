"""`compare`: log parsers and the metric math."""
