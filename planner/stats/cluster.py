"""Which experts a layer keeps: clustering of experts, one real representative per cluster.

Methods (per MoE layer, and within each routing group when routing is grouped):
  agglomerative  average linkage on a blended distance: (1 - w) x output distance + w x router
                 distance (HC-SMoE / REAP-merge use output similarity; router similarity predicts
                 routing, MC-SMoE; w = 0.3, docs/proxy-rules.md section "Choosing the kept
                 experts"). Without calibration the output distance is the weight-sketch distance.
  kmeans         k-means++ on a low-dimensional embedding of the same distances (classical MDS)
  router         average linkage on the router distance alone
  saliency       keep the K most salient experts (REAP: router-weighted output norm)
  frequency      keep the K most often routed experts
  random         K experts drawn with the seed (a baseline)
  least-used     the K least often routed experts (deliberately bad: keeps the dead experts)
  one-cluster    one tight cluster: the expert whose K-1 nearest neighbours are closest, and those
                 neighbours (deliberately bad: K near-copies of one expert)
Representative of a cluster: a "super expert" (extreme max activation, which pruning breaks; arXiv
2507.23279) if the cluster has one, else the most salient member, else (no calibration) the medoid.
Ranking methods label every dropped expert with its nearest kept one.
"""

from __future__ import annotations

import numpy as np

from planner.errors import SpecError
from planner.plan import SELECTION_METHODS as METHODS

__all__ = ["cosine_distance", "agglomerative", "kmeans", "mds_embedding", "select", "silhouette", "METHODS"]

ROUTER_WEIGHT = 0.3


def cosine_distance(x: np.ndarray) -> np.ndarray:
    """(1 - cos) / 2 between rows, in [0, 1]."""
    x = np.asarray(x, dtype=np.float64)
    gram = x @ x.T  # one pass over x (rows are long: expert outputs on hundreds of tokens)
    norm = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    norm = np.where(norm > 0, norm, 1.0)
    d = (1.0 - np.clip(gram / np.outer(norm, norm), -1.0, 1.0)) / 2.0
    np.fill_diagonal(d, 0.0)
    return d


def agglomerative(d: np.ndarray, k: int) -> np.ndarray:
    """Average-linkage agglomerative clustering into exactly k clusters (deterministic: ties merge
    the lowest indices). Labels are numbered by each cluster's smallest member."""
    n = len(d)
    clusters: list[list[int]] = [[i] for i in range(n)]
    dist = d.astype(np.float64).copy()
    np.fill_diagonal(dist, np.inf)
    sizes = np.ones(n)
    alive = np.ones(n, dtype=bool)
    for _ in range(n - k):
        masked = np.where(alive[:, None] & alive[None, :], dist, np.inf)
        a, b = np.unravel_index(np.argmin(masked), masked.shape)
        a, b = min(a, b), max(a, b)
        # average linkage: the merged cluster's distance is the size-weighted mean (Lance-Williams)
        merged = (sizes[a] * dist[a] + sizes[b] * dist[b]) / (sizes[a] + sizes[b])
        dist[a, :] = merged
        dist[:, a] = merged
        dist[a, a] = np.inf
        sizes[a] += sizes[b]
        alive[b] = False
        clusters[a].extend(clusters[b])
    return _labels([sorted(c) for i, c in enumerate(clusters) if alive[i]], n)


def _labels(groups: list[list[int]], n: int) -> np.ndarray:
    labels = np.empty(n, dtype=np.int64)
    for label, members in enumerate(sorted(groups, key=min)):
        labels[members] = label
    return labels


def mds_embedding(d: np.ndarray, dims: int = 16) -> np.ndarray:
    """Classical multidimensional scaling: coordinates whose Euclidean distances approximate d."""
    n = len(d)
    j = np.eye(n) - np.ones((n, n)) / n
    b = -0.5 * j @ (d**2) @ j
    vals, vecs = np.linalg.eigh(b)
    order = np.argsort(vals)[::-1][: min(dims, n)]
    return vecs[:, order] * np.sqrt(np.maximum(vals[order], 0.0))


def kmeans(x: np.ndarray, k: int, seed: int = 0, iters: int = 100) -> np.ndarray:
    """k-means++ then Lloyd iterations; empty clusters take the farthest point. Exactly k labels."""
    rng = np.random.default_rng(seed)
    n = len(x)
    centers = [x[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None, :] - np.array(centers)[None]) ** 2).sum(-1), axis=1)
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1 / n)
        centers.append(x[rng.choice(n, p=p)])
    c = np.array(centers)
    labels = np.zeros(n, dtype=np.int64)
    for it in range(iters):
        dist = ((x[:, None, :] - c[None]) ** 2).sum(-1)
        new = dist.argmin(1)
        for j in range(k):
            if not (new == j).any():  # refill from a cluster that can spare a member
                counts = np.bincount(new, minlength=k)
                donors = np.flatnonzero(counts[new] > 1)
                far = int(donors[np.argmax(dist[donors, new[donors]])])
                new[far] = j
        if it > 0 and (new == labels).all():
            break
        labels = new
        c = np.array([x[labels == j].mean(0) for j in range(k)])  # every cluster has a member
    return _labels([list(np.flatnonzero(labels == j)) for j in range(k)], n)


def silhouette(d: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette coefficient (singletons count 0, as scikit-learn does)."""
    n, scores = len(d), []
    for i in range(n):
        same = labels == labels[i]
        if same.sum() <= 1:
            scores.append(0.0)
            continue
        a = d[i, same & (np.arange(n) != i)].mean()
        b = min(d[i, labels == other].mean() for other in np.unique(labels) if other != labels[i])
        scores.append((b - a) / max(a, b) if max(a, b) > 0 else 0.0)
    return float(np.mean(scores))


def _representatives(labels: np.ndarray, d: np.ndarray, saliency: np.ndarray | None, protected: set[int]) -> list[int]:
    kept = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        guarded = [m for m in members if m in protected]
        if guarded:
            kept.append(int(guarded[0]))
        elif saliency is not None:
            kept.append(int(members[np.argmax(saliency[members])]))
        else:  # medoid
            kept.append(int(members[np.argmin(d[np.ix_(members, members)].sum(1))]))
    return kept


def _nearest_labels(kept: list[int], d: np.ndarray) -> np.ndarray:
    kept_arr = np.array(sorted(kept))
    owner = kept_arr[np.argmin(d[:, kept_arr], axis=1)]
    owner[kept_arr] = kept_arr
    return _labels([list(np.flatnonzero(owner == k)) for k in kept_arr], len(d))


def select(
    method: str,
    k: int,
    *,
    distance: np.ndarray,
    router_distance: np.ndarray,
    saliency: np.ndarray | None = None,
    frequency: np.ndarray | None = None,
    protected: set[int] = frozenset(),
    n_group: int = 1,
    seed: int = 0,
) -> tuple[list[int], np.ndarray]:
    """(kept original ids ascending, cluster label of every expert) for one layer."""
    if method not in METHODS:
        raise SpecError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    n = len(distance)
    per_group, k_group = n // n_group, k // n_group
    kept: list[int] = []
    labels = np.empty(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    for g in range(n_group):
        idx = np.arange(g * per_group, (g + 1) * per_group)
        dg, rg = distance[np.ix_(idx, idx)], router_distance[np.ix_(idx, idx)]
        sal = None if saliency is None else saliency[idx]
        prot = {int(i - idx[0]) for i in protected if idx[0] <= i < idx[-1] + 1}
        if method in ("agglomerative", "router", "kmeans"):
            if method == "kmeans":
                lab = kmeans(mds_embedding(dg), k_group, seed=seed)
            else:
                lab = agglomerative(dg if method == "agglomerative" else rg, k_group)
            chosen = _representatives(lab, dg, sal, prot)
        else:
            if method == "random":
                chosen = sorted(int(i) for i in rng.choice(per_group, size=k_group, replace=False))
            elif method == "one-cluster":
                near = np.sort(dg, axis=1)[:, :k_group].sum(1)  # itself (0) and its k-1 nearest
                centre = int(np.argmin(near))
                chosen = sorted(int(i) for i in np.argsort(dg[centre], kind="stable")[:k_group])
            elif method == "least-used":
                if frequency is None:
                    raise SpecError("method 'least-used' ranks experts by routing frequency; run planner stats with calibration text")
                chosen = sorted(int(i) for i in np.argsort(frequency[idx], kind="stable")[:k_group])
            else:
                score = sal if method == "saliency" else (None if frequency is None else frequency[idx])
                if score is None:
                    raise SpecError(
                        f"method {method!r} ranks experts by calibration statistics; run planner stats (without "
                        "--weights-only) and pass --stats"
                    )
                score = score.astype(float).copy()
                score[list(prot)] = np.inf
                chosen = sorted(int(i) for i in np.argsort(-score, kind="stable")[:k_group])
            lab = _nearest_labels(chosen, dg)
        kept.extend(int(idx[c]) for c in chosen)
        labels[idx] = lab + g * k_group
    return sorted(kept), labels
