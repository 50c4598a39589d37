"""The fast path of repeated calls: the call memo of a prepared transfer and the bindings kept
between one-shot calls. It uses the semantic classes below it and changes no result."""
