"""Reusable layers that return constrained distributions."""

from .graph import GraphGaussianHead, GraphNormal, graph_normal, per_graph_log_prob, variance_weighted_correction
from .heads import ConstrainedGaussianHead
from .vae import ConstrainedGaussianLatent, ConstrainedGaussianObservation, importance_log_likelihood

__all__ = ["ConstrainedGaussianHead", "ConstrainedGaussianLatent", "ConstrainedGaussianObservation",
           "GraphGaussianHead", "GraphNormal", "graph_normal", "importance_log_likelihood", "per_graph_log_prob",
           "variance_weighted_correction"]
