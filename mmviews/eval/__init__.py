"""Evaluation: probes, metrics, retrieval, diagnostics and reports.

Entry point for the trainer and ``mmviews eval``: :func:`evaluate_encoder`.
"""

from mmviews.eval.diagnostics import (
    alignment,
    effective_rank,
    mi_lower_bound,
    numerical_rank,
    representation_diagnostics,
    similarity_samples,
    singular_values,
    uniformity,
    vmf_kde_entropy,
    vmf_log_normaliser,
)
from mmviews.eval.evaluate import evaluate_encoder
from mmviews.eval.tasks import EvalTask, parse_tasks
from mmviews.eval.extract import Embeddings, extract_embeddings, fuse_views
from mmviews.eval.metrics import ACC2_CONVENTIONS, msa_metrics, weighted_f1
from mmviews.eval.probes import (
    DEFAULT_WEIGHT_DECAYS,
    ProbeResult,
    class_prototype_accuracy,
    knn_accuracy,
    knn_predict,
    linear_probe_classification,
    linear_probe_regression,
)
from mmviews.eval.report import plot_similarity_histograms, plot_spectrum, plot_training_curves, write_report
from mmviews.eval.retrieval import cross_view_retrieval, retrieval_metrics, retrieval_ranks

__all__ = [
    "ACC2_CONVENTIONS",
    "DEFAULT_WEIGHT_DECAYS",
    "Embeddings",
    "EvalTask",
    "evaluate_encoder",
    "parse_tasks",
    "plot_similarity_histograms",
    "plot_spectrum",
    "plot_training_curves",
    "write_report",
    "ProbeResult",
    "class_prototype_accuracy",
    "alignment",
    "cross_view_retrieval",
    "effective_rank",
    "extract_embeddings",
    "fuse_views",
    "knn_accuracy",
    "knn_predict",
    "linear_probe_classification",
    "linear_probe_regression",
    "mi_lower_bound",
    "msa_metrics",
    "numerical_rank",
    "representation_diagnostics",
    "retrieval_metrics",
    "retrieval_ranks",
    "similarity_samples",
    "singular_values",
    "uniformity",
    "vmf_kde_entropy",
    "vmf_log_normaliser",
    "weighted_f1",
]
