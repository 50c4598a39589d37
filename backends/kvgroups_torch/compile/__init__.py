"""``torch.compile`` support: the public calls substituted for Dynamo, and the custom ops a
transfer becomes inside a compiled graph."""
