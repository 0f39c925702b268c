"""Lock files, downloads through huggingface_hub, the SHA-256 manifest and verification."""
