"""``torch.compile`` support: Dynamo substitutions of the public calls, and their custom ops."""
