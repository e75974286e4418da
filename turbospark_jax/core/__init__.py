"""The runtime's core values and rules: argument checks, state pieces, the producer protocols,
sampling, stop strings, detokenizing and streams. Imports nothing of the package but its errors.
"""
