"""top-k, top-p and min-p as per-row candidate sets on temperature-scaled logits.

Input rows are temperature-scaled logits whose row maximum is exactly 0 (the sampler subtracts the
maximum before dividing by the temperature), so ``exp(z)`` is a token's probability relative to
the most likely token. The filters are applied in this order and their kept sets intersected:

- top-k (k >= V disables): keep every token whose logit is >= the k-th largest logit (so tokens
  tied with the k-th are kept too).
- top-p (p >= 1 disables), on the distribution renormalised over the top-k set: sort descending,
  keep the smallest prefix whose probability mass reaches p (``mass before token < p``; the top token
  is always kept) and every token tied with the last kept one.
- min-p (<= 0 disables): drop tokens with ``prob < min_p * max prob``, i.e. keep ``exp(z) >= min_p``
  (renormalisation by the other filters does not change this ratio).

Every kept set is "all tokens with a logit >= some threshold", so the candidates of a row are a
prefix of its tokens sorted by logit. `select_candidates` looks at the first `width` of them
(torch.topk, cheap) and redoes the rows whose kept set might not fit in that prefix with a wider one,
up to a full sort; every width gives the same candidates. Probabilities are float32 (a logsumexp
per row, then a cumsum); on CPU every reduction is per row, so a row's candidates never depend on
the rest of the batch (batched GPU reductions may round differently, which could move a top-p
boundary only where the mass is within float rounding of p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIDTH_GROWTH = 16


@dataclass
class Candidates:
    """The sorted prefix of some rows' tokens and which of them survive the filters."""

    rows: torch.Tensor | None  # [F'] rows of the input these belong to; None = all rows, in order
    vals: torch.Tensor  # [F', W] float32 scaled logits, descending
    ids: torch.Tensor  # [F', W] int64 vocabulary ids of vals
    keep: torch.Tensor  # [F', W] bool


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, [N, W] -> [N].

    On CPU each row is reduced on its own, so the result of a row never depends on how many rows are
    batched with it (a batched reduction may split the work, and round, differently).
    """
    if x.device.type == "cpu" and x.shape[0] > 1:
        return torch.stack([torch.logsumexp(row, dim=-1) for row in x])
    return torch.logsumexp(x, dim=-1)


def _candidates(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """vals, ids, keep [F, W] and covered [F] (None when W == V: a full sort always covers)."""
    v = z.shape[1]
    w = min(width, v)
    if w == v:
        vals, ids = torch.sort(z, dim=-1, descending=True)  # [F, V]
    else:
        vals, ids = torch.topk(z, w, dim=-1)  # [F, W], sorted descending
    neg_inf = z.new_full((), float("-inf"))  # a fill, not a host-to-device copy
    keep = torch.ones_like(vals, dtype=torch.bool)  # [F, W]
    topk_on = None
    thr_k = None
    if top_k is not None:
        topk_on = top_k < v  # [F]
        kth = vals.gather(1, (top_k.clamp(max=w) - 1)[:, None]).squeeze(1)  # [F]
        thr_k = torch.where(topk_on, kth, neg_inf)  # [F]
        keep &= vals >= thr_k[:, None]
    if top_p is not None:
        masked = torch.where(keep, vals, neg_inf)  # [F, W]: the top-k distribution
        lse = row_logsumexp(z)  # [F]
        if topk_on is not None:
            lse = torch.where(topk_on, row_logsumexp(masked), lse)
        probs = torch.exp(masked - lse[:, None])  # [F, W]
        cum = probs.cumsum(dim=-1)  # [F, W]
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # [F, W] mass before token
        n_keep = (before < top_p[:, None]).sum(dim=-1)  # [F] >= 1 since top_p > 0
        last = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)  # [F]
        thr_p = torch.where(top_p < 1.0, last, neg_inf)  # [F]
        keep &= vals >= thr_p[:, None]
    if min_p is not None:
        keep &= torch.exp(vals) >= min_p[:, None]
    if w == v:
        return vals, ids, keep, None
    # All candidates are in the prefix iff its last token is dropped; top-k rows also need the whole
    # top-k set (ties included) inside it, since top-p renormalises over that set.
    covered = ~keep[:, -1]
    if topk_on is not None:
        assert thr_k is not None
        covered &= ~topk_on | (vals[:, -1] < thr_k)
    return vals, ids, keep, covered


def select_candidates(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    width: int | None = None,
) -> list[Candidates]:
    """Candidate sets of rows z [F, V] (row max 0); top_k [F] int64, top_p/min_p [F] float32 or None.

    A None parameter means no row uses that filter; a row that does not use a given filter carries
    a neutral value (top_k = V, top_p = 1, min_p = 0). width bounds the sorted prefix examined first
    (None: a full sort); rows whose kept set may not fit are redone with a prefix WIDTH_GROWTH times
    wider, or a full sort once that is V/4 or more. Returns groups that together cover every row once.
    """
    v = z.shape[1]
    w = v if width is None else max(1, width)
    groups: list[Candidates] = []
    rows: torch.Tensor | None = None  # rows of z still to do; None = all
    params = (top_k, top_p, min_p)
    while True:
        sub = params if rows is None else tuple(None if t is None else t[rows] for t in params)
        zz = z if rows is None else z[rows]
        vals, ids, keep, covered = _candidates(zz, sub[0], sub[1], sub[2], w)
        if covered is None or bool(covered.all()):
            groups.append(Candidates(rows, vals, ids, keep))
            return groups
        ok = covered.nonzero().squeeze(1)  # [F1] positions within this pass
        if ok.numel():
            groups.append(Candidates(ok if rows is None else rows[ok], vals[ok], ids[ok], keep[ok]))
        redo = (~covered).nonzero().squeeze(1)
        rows = redo if rows is None else rows[redo]
        w = w * WIDTH_GROWTH
        if w * 4 >= v:  # a prefix this wide costs about as much as a full sort
            w = v


def keep_mask(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    width: int | None = None,
) -> torch.Tensor:
    """Dense form of select_candidates: bool [F, V], True where a token survives the filters."""
    mask = torch.zeros_like(z, dtype=torch.bool)  # [F, V]
    for c in select_candidates(z, top_k, top_p, min_p, width):
        rows = torch.arange(z.shape[0], device=z.device) if c.rows is None else c.rows
        mask[rows[:, None].expand_as(c.ids), c.ids] = c.keep
    return mask
