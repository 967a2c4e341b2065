"""Reusable layers that return constrained distributions."""

from .graph import GraphGaussianHead, graph_normal, per_graph_log_prob, variance_weighted_correction
from .heads import ConstrainedGaussianHead

__all__ = ["ConstrainedGaussianHead", "GraphGaussianHead", "graph_normal", "per_graph_log_prob",
           "variance_weighted_correction"]
