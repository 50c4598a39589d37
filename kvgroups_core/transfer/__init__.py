"""Transfers: backend protocol, plans, planner, checks, reference backend and the public calls."""
