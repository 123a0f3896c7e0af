"""Speculative decoding: proposers that guess a request's next tokens, which the next
step verifies all at once (docs/speculative-decoding.md)."""
