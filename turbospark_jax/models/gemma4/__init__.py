"""The Gemma 4 family: text decoder, vision tower and assistant drafter."""
