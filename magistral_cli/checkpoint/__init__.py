"""Key maps (official HF <-> transformers <-> megatron), HF <-> DCP conversion, validation, export."""
