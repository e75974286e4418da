"""The block program (one jitted loop over blocks of rows serving produce, prefill, verify and
decode) and the producer built on it."""
