"""Planning: cluster files, placement plans, the planner and its cost model, and routing statistics.

Callers import from here. Planning may use the model's configuration (inference.model); the model never
imports planning.
"""
from inference.planning.cost_model import CostModel, CostParams
from inference.planning.plan import LayerRouting, Plan, PlanError, RoutingStats
from inference.planning.planner import Cluster, ClusterError, PlanDoesNotFit, PlannerOptions, plan_cluster
from inference.planning.routing import RoutingRecorder, merge_routing_stats

__all__ = [
    "Cluster", "ClusterError", "CostModel", "CostParams", "LayerRouting", "Plan", "PlanDoesNotFit", "PlanError",
    "PlannerOptions", "RoutingRecorder", "RoutingStats", "merge_routing_stats", "plan_cluster",
]
