"""The fast path of repeated calls: the call memo and the one-shot binding kept for reuse.

It uses the semantic classes below it and changes no result.
"""
