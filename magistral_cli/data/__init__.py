"""Readers, chat template, Pixtral image tokens, encoder, cache, collator, samplers, loader."""
