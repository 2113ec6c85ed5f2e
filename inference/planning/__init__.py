"""Placement planning: cluster files, plans, the planner and the cost model."""
