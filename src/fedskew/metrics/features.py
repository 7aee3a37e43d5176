"""Feature quality of a model, as FedFM's Table IV and Fig. 6 measure it, and the risk of
local models over client distributions, as FedACD's Table 3 measures it.

Feature quality (FedFM, Sec. VII, Table IV): the body features of a fixed test subsample
are clustered by k-means with k = number of classes; the NMI between those clusters and the
labels measures how well the feature space separates the classes without the head, and the
silhouette score measures how compact and apart the classes are. FedFM says both come from
scikit-learn; the rest is open and chosen here:

* [PROPOSAL] the silhouette is computed with the **class labels** as the clusters
  (``silhouette_score(features, labels)``): the paper's sentence fits either labelling, the
  k-means partition is already judged by the NMI, and the class labelling measures what
  Fig. 6 shows (compact category-wise regions with clear boundaries).
* [PROPOSAL] raw body features (the head's input), Euclidean distance, no standardisation;
  k-means with scikit-learn's defaults (k-means++, ``n_init=10``), seeded from the
  experiment seed; NMI with the arithmetic-mean normalisation (scikit-learn's default).
* The subsample: :data:`FEATURE_SAMPLE` test samples drawn once from the experiment seed
  (``fedskew.core.rng``, purpose ``"feature-sample"``), the same every round and for every
  method of that seed, so curves and methods are compared on the same points; a smaller
  test set is used whole. Why 2,000 (``benchmarks/results/feature_metrics_cost.md``,
  CIFAR-10, FedAvg's CNN after 3 rounds, 10 subsamples per size): the spread from
  subsample to subsample is 0.007 (NMI) and 0.005 (silhouette) at 2,000, against 0.019 and
  0.015 at 500 and 0.004 at 5,000; k-means + silhouette take 0.7 s at 2,000, 3-4 s at 5,000
  and 7-8 s on the whole 10,000 (the silhouette is quadratic), and the t-SNE of the same
  points takes about a minute (49-75 s on the 2-core CPU shared with other jobs). The NMI
  of a sample is biased upwards (+0.012 at 2,000 against the whole test set there):
  compare methods at the same size.

Risk of local models over client distributions (FedACD, Eq. 3 and Table 3, [RECON] in
ALGORITHMS.md Sec. 3.1 and 3.9): a local model w_m has per-class test error eps_i (from the
whole test set); its risk over client distributions is
R(w_m) = 1/M sum_n sum_i pi^n_i eps_i, the error it would make on test sets shaped like
each client's label distribution pi^n, averaged over the M clients. The metric is the mean
of R(w_m) over the round's local models (FedACD's "average risk of local models").
Choices:

* [PROPOSAL] pi^n are the clients' training label proportions, over every client with
  data (not only the round's); a class absent from the test set counts as always wrong,
  as in ``client_distribution_accuracy`` (test sets hold every class in practice). So
  R(w) = 1 - ``client_distribution_accuracy`` of w, and the global model's own risk is
  ``1 - client_dist_accuracy`` of its metrics line.
* The error is the 0-1 error (FedACD's risk is a misclassification probability), not the
  cross-entropy.
* The local models are the models the round's clients uploaded after local training (the
  run loop reads them from the replies; see ``fedskew.runs.loop``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from fedskew.core.precision import autocast
from fedskew.core.rng import derive_seed, numpy_rng
from fedskew.metrics.evaluation import client_distribution_accuracy, evaluate

FEATURE_SAMPLE = 2000  # test samples whose features are scored (see the module docstring)
SAMPLE_PURPOSE = "feature-sample"
KMEANS_PURPOSE = "feature-kmeans"
TSNE_PURPOSE = "feature-tsne"
# scikit-learn's OpenMP/BLAS threads during k-means, silhouette and t-SNE. One: these problems
# are small, and on the shared 2-core machine (load average 14) two spinning threads took
# 9.6 s instead of 0.42 s for k-means + silhouette of 2,000 x 84 features, and 129 s instead
# of 29 s for their t-SNE.
ONE_THREAD = 1


@dataclass
class FeatureQuality:
    nmi: float  # NMI of k-means clusters (k = classes) against the labels
    silhouette: float  # silhouette of the features with the labels as clusters


def feature_sample(num_test: int, seed: int, size: int = FEATURE_SAMPLE) -> np.ndarray:
    """The sorted test-set indices of the seeded subsample (the whole set when smaller)."""
    if num_test <= size:
        return np.arange(num_test)
    rng = numpy_rng(seed, purpose=SAMPLE_PURPOSE)
    return np.sort(rng.choice(num_test, size=size, replace=False))


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


@torch.inference_mode()
def body_features(
    model: torch.nn.Module, x: torch.Tensor, batch_size: int = 1024, precision: str = "fp32"
) -> np.ndarray:
    """``model.body(x)`` in eval mode, as a float32 (N, feature_dim) array; batches of ``x``
    go to the model's device."""
    was_training = model.training
    model.eval()
    device = device_of(model)
    parts = []
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size].to(device)
        with autocast(precision, xb.device.type):
            h = model.body(xb)
        parts.append(h.float().reshape(len(xb), -1).cpu())
    model.train(was_training)
    return torch.cat(parts).numpy().astype(np.float32, copy=False)


def sklearn_seed(seed: int, purpose: str) -> int:
    """A scikit-learn ``random_state`` (< 2**32) for the experiment seed and purpose."""
    return derive_seed(seed, purpose=purpose) % (2**32)


def feature_quality(
    features: np.ndarray, labels: np.ndarray, num_classes: int, seed: int
) -> FeatureQuality:
    """NMI of k-means clusters (k = ``num_classes``) against ``labels``, and the silhouette
    score of ``features`` with ``labels`` as the clusters. A value that is undefined (fewer
    than 2 distinct labels, or as many labels as samples) is NaN."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score, silhouette_score
    from threadpoolctl import threadpool_limits

    features = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels)
    n = len(labels)
    k = min(num_classes, n)
    distinct = len(np.unique(labels))
    with threadpool_limits(ONE_THREAD), warnings.catch_warnings():
        # Collapsed features (fewer distinct points than k) are a finding, not an error:
        # k-means then warns and the NMI comes out low.
        warnings.simplefilter("ignore")
        clusters = KMeans(
            n_clusters=k, n_init=10, random_state=sklearn_seed(seed, KMEANS_PURPOSE)
        ).fit_predict(features)
        valid = 2 <= distinct < n
        silhouette = float(silhouette_score(features, labels)) if valid else float("nan")
    nmi = float(normalized_mutual_info_score(labels, clusters))
    return FeatureQuality(nmi=nmi, silhouette=silhouette)


def tsne_embedding(features: np.ndarray, seed: int) -> np.ndarray:
    """A 2-D t-SNE of ``features`` (scikit-learn, PCA initialisation, perplexity 30 or
    less for small samples), seeded from the experiment seed."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    n = len(features)
    perplexity = float(min(30.0, max(1.0, (n - 1) / 3)))
    tsne = TSNE(
        n_components=2,
        perplexity=perplexity,
        init="pca",
        random_state=sklearn_seed(seed, TSNE_PURPOSE),
    )
    with threadpool_limits(ONE_THREAD):
        coords = tsne.fit_transform(np.asarray(features, dtype=np.float32))
    return coords.astype(np.float32)


def risk_over_clients(per_class_accuracy: np.ndarray, client_counts: np.ndarray) -> float:
    """FedACD's Eq. 3: the mean over clients (with data) of the test error reweighted to
    each client's label proportions, from a model's per-class test accuracy."""
    return 1.0 - client_distribution_accuracy(per_class_accuracy, client_counts)


def per_class_accuracy(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    batch_size: int = 1024,
    precision: str = "fp32",
) -> np.ndarray:
    """Test accuracy per class (NaN for a class absent from ``y``), counted by ``evaluate``
    (arg-max of the fp32 logits); ``x`` and ``y`` go to the model's device (nothing moves
    when they are there already)."""
    device = device_of(model)
    result = evaluate(model, x.to(device), y.to(device), num_classes, batch_size, precision)
    return result.per_class_accuracy


def local_model_risk(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    client_counts: np.ndarray,
    precision: str = "fp32",
) -> float:
    """:func:`risk_over_clients` of ``model`` (loaded with a local model) on the test set."""
    accuracy = per_class_accuracy(model, x, y, num_classes, precision=precision)
    return risk_over_clients(accuracy, client_counts)
