"""Builders of tiny models, tokenizers and datasets shared by the tests and the quickstart.

Nothing here reaches the network: the tokenizer is the real Tekken vocabulary shipped in
mistral-common's package data, images come from PIL, weights are random.
"""
