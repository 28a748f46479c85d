"""Per-microbatch costs of variable-length batches: a length-based cost model and the factors the
core's ``ir.Setting`` takes (``Setting.microbatch_costs``). Pure Python.

A microbatch holds one or more sequences of lengths s_1..s_n, **packed** (Megatron's packed-sequence
THD format: one after another, attention within each) or **padded** (n rows of the longest, L).
One pass of kind k (F, B, W) over a whole stage takes

    t_k = c0_k + c1_k * tokens + c2_k * sum of s_i^2          (padded: tokens = n L, sum = n L^2)

a fixed part per pass (launches, small-kernel inefficiency), the linear layers' work per token and
attention's work per pair of tokens; W has no attention term (attention has no weights). Activation
memory grows with the tokens (flash attention keeps no s^2 scores).

A ``Setting``'s cost_f/b/w and mem_f are those of the **reference microbatch**, one sequence of
``seq_length`` tokens (S). ``LengthModel`` holds, per pass kind, the share of that time that is fixed
(``overhead``) and the share that is attention (``attention``); a microbatch's factor is then

    factor_k = o_k + (1 - o_k - a_k) * tokens / S + a_k * sum(s^2) / S^2

``fit`` finds c0, c1, c2 from passes timed at several lengths (least squares, no negative term), as
the profile window measures them, and turns them into a ``LengthModel``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..ir import B, F, ScheduleError, W

__all__ = ["LengthModel", "MicrobatchCosts", "fit", "fit_stages", "microbatch_shape", "attention_share"]

KINDS = (F, B, W)


def microbatch_shape(lengths: Sequence[int], packed: bool = True) -> Tuple[int, int]:
    """(tokens, sum of squared sequence lengths) of a microbatch of these sequences."""
    if not lengths:
        raise ScheduleError("a microbatch needs at least one sequence")
    if packed:
        return sum(lengths), sum(s * s for s in lengths)
    top = max(lengths)
    return len(lengths) * top, len(lengths) * top * top


def _share(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0.0 <= x <= 1.0):
        raise ScheduleError(f"{name} must be a share between 0 and 1, got {x!r}")
    return float(x)


@dataclass(frozen=True)
class LengthModel:
    """How a pass's time grows with its microbatch's sequences (module doc). ``seq_length``: the
    reference microbatch's tokens; ``attention`` / ``overhead``: per kind (F, B, W), the share of the
    reference pass spent in attention (quadratic) / fixed; a kind left out has none."""

    seq_length: int
    attention: Mapping[str, float] = field(default_factory=dict)
    overhead: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.seq_length, bool) or not isinstance(self.seq_length, int) or self.seq_length < 1:
            raise ScheduleError(f"the reference sequence length must be an integer >= 1, got {self.seq_length!r}")
        for what in ("attention", "overhead"):
            d = dict(getattr(self, what))
            for k, v in d.items():
                if k not in KINDS:
                    raise ScheduleError(f"{what} shares are per pass kind F, B, W; got {k!r}")
                d[k] = _share(f"the {what} share of {k}", v)
            object.__setattr__(self, what, d)
        if self.attention.get(W, 0.0):
            raise ScheduleError("W has no attention term (attention holds no weights): leave it out")
        for k in KINDS:
            if self.attention.get(k, 0.0) + self.overhead.get(k, 0.0) > 1.0 + 1e-12:
                raise ScheduleError(f"{k}: the attention and fixed shares add up to more than the whole pass "
                                    f"({self.attention.get(k, 0.0):g} + {self.overhead.get(k, 0.0):g})")

    @classmethod
    def simple(cls, seq_length: int, attention: float = 0.0, overhead: float = 0.0) -> "LengthModel":
        """One attention share for F and B (W none) and one fixed share for every kind."""
        return cls(seq_length, {F: attention, B: attention}, {k: overhead for k in KINDS})

    def factor(self, kind: str, tokens: float, sum_sq: float) -> float:
        """A pass of ``kind`` over a microbatch of ``tokens`` tokens and ``sum_sq`` = sum of s^2,
        against the reference microbatch."""
        S = float(self.seq_length)
        a, o = self.attention.get(kind, 0.0), self.overhead.get(kind, 0.0)
        return o + (1.0 - o - a) * tokens / S + a * sum_sq / (S * S)

    def sequence_cost(self, s: int, weights: Mapping[str, float]) -> float:
        """One sequence of ``s`` tokens alone, with each kind's reference time ``weights[kind]``
        (the balancer's cost of a sequence: fixed parts left out, they come per microbatch)."""
        S = float(self.seq_length)
        out = 0.0
        for k, w in weights.items():
            a, o = self.attention.get(k, 0.0), self.overhead.get(k, 0.0)
            out += w * ((1.0 - o - a) * s / S + a * s * s / (S * S))
        return out

    def costs(self, microbatches: Sequence[Sequence[int]], packed: bool = True) -> "MicrobatchCosts":
        """The factors of each microbatch (lists of sequence lengths, in microbatch order)."""
        shapes = [microbatch_shape(mb, packed) for mb in microbatches]
        S = float(self.seq_length)
        fac = {k: [self.factor(k, t, q) for t, q in shapes] for k in KINDS}
        fac["tokens"] = [t / S for t, _ in shapes]
        fac["mem"] = list(fac["tokens"])
        return MicrobatchCosts(fac, [list(mb) for mb in microbatches])

    def to_dict(self) -> dict:
        return {"seq_length": self.seq_length, "attention": dict(self.attention), "overhead": dict(self.overhead)}


@dataclass(frozen=True)
class MicrobatchCosts:
    """Per microbatch, its factor on each pass kind's time (F, B, W), on its all-to-all
    ('tokens') and on its activation memory ('mem'), against the reference microbatch; and, for
    the record, the sequence lengths each holds."""

    factors: Dict[str, List[float]]
    lengths: Optional[List[List[int]]] = None

    def __post_init__(self):
        n = {len(v) for v in self.factors.values()}
        if set(self.factors) != set(KINDS + ("tokens", "mem")) or len(n) != 1:
            raise ScheduleError("microbatch costs need one factor per microbatch for F, B, W, tokens and mem")
        for k, v in self.factors.items():
            for x in v:
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0.0 <= x < float("inf")):
                    raise ScheduleError(f"microbatch cost factors must be non-negative numbers, got {x!r} ({k})")

    @property
    def count(self) -> int:
        return len(self.factors[F])

    def factor(self, what: str, mb: int) -> float:
        return self.factors[what][mb]

    def check(self, microbatches: int) -> None:
        if self.count != microbatches:
            raise ScheduleError(f"per-microbatch costs for {self.count} microbatches, but the setting has "
                                f"{microbatches}")

    def mean(self, what: str) -> float:
        v = self.factors[what]
        return sum(v) / len(v)

    def to_dict(self) -> dict:
        return {"factors": {k: [round(x, 6) for x in v] for k, v in self.factors.items()},
                "lengths": self.lengths}


# -- calibration ------------------------------------------------------------------------------

def _solve(a: List[List[float]], b: List[float]) -> Optional[List[float]]:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for j in range(c, n + 1):
                    m[r][j] -= f * m[c][j]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(rows: List[Tuple[float, ...]], y: List[float], terms: List[int]) -> Optional[List[float]]:
    """Least squares over the columns ``terms`` of ``rows`` (scaled for conditioning)."""
    scale = [max(abs(r[t]) for r in rows) or 1.0 for t in terms]
    x = [[r[t] / s for t, s in zip(terms, scale)] for r in rows]
    ata = [[sum(xi[i] * xi[j] for xi in x) for j in range(len(terms))] for i in range(len(terms))]
    aty = [sum(xi[i] * yi for xi, yi in zip(x, y)) for i in range(len(terms))]
    sol = _solve(ata, aty)
    return None if sol is None else [c / s for c, s in zip(sol, scale)]


def fit_coefficients(samples: Sequence[Tuple[float, float, float]], quadratic: bool = True) -> Tuple[float, float, float]:
    """(c0, c1, c2) of t = c0 + c1 tokens + c2 sum_sq from (tokens, sum_sq, seconds) samples, none
    negative (a term the fit makes negative is dropped and the rest fitted again)."""
    if len(samples) < 1:
        raise ScheduleError("fitting the length model needs measured passes")
    rows = [(1.0, float(t), float(q)) for t, q, _ in samples]
    y = [float(s) for _, _, s in samples]
    candidates = [[0, 1, 2], [1, 2], [0, 1], [1]] if quadratic else [[0, 1], [1]]
    for terms in candidates:
        if len({tuple(r[t] for t in terms) for r in rows}) < len(terms):
            continue  # too few distinct shapes to tell these terms apart
        sol = _least_squares(rows, y, terms)
        if sol is not None and all(c >= 0 for c in sol):
            out = [0.0, 0.0, 0.0]
            for t, c in zip(terms, sol):
                out[t] = c
            return out[0], out[1], out[2]
    mean_rate = sum(y) / max(sum(r[1] for r in rows), 1e-300)
    return 0.0, mean_rate, 0.0


def attention_share(c: Tuple[float, float, float], seq_length: int) -> Tuple[float, float, float]:
    """(reference time, attention share, fixed share) of coefficients ``c`` at one sequence of
    ``seq_length`` tokens."""
    c0, c1, c2 = c
    S = float(seq_length)
    t = c0 + c1 * S + c2 * S * S
    if t <= 0:
        return 0.0, 0.0, 0.0
    return t, c2 * S * S / t, c0 / t


def fit(samples: Mapping[str, Sequence[Tuple[float, float, float]]], seq_length: int) -> Tuple[LengthModel, Dict[str, float]]:
    """A ``LengthModel`` for reference length ``seq_length`` from timed passes: per kind (F, B, W),
    (tokens, sum of s^2, seconds) of whole-stage passes at several lengths. Returns the model and
    each kind's fitted time of the reference microbatch (the costs a Setting takes)."""
    att, fixed, ref = {}, {}, {}
    for k in KINDS:
        if not samples.get(k):
            continue
        t, a, o = attention_share(fit_coefficients(samples[k], quadratic=k != W), seq_length)
        ref[k] = t
        if a:
            att[k] = min(a, 1.0)
        if o:
            fixed[k] = min(o, 1.0 - att.get(k, 0.0))
    return LengthModel(seq_length, att, fixed), ref


def fit_stages(samples: Mapping[str, Mapping[int, Sequence[Tuple[float, float, float]]]], seq_length: int,
               min_shapes: int = 3) -> Optional[Tuple[LengthModel, Dict[str, List[float]]]]:
    """The length model of a whole pipeline from passes timed per stage: ``samples[kind][stage]``
    = (tokens, sum of s^2, seconds) of that stage's passes (a profile window's, microbatches of
    several lengths). Each stage's coefficients are fitted (``fit_coefficients``); the model's
    shares are those of their sum over the stages, and each stage's reference time (one sequence
    of ``seq_length`` tokens) is its own fit's. Returns (model, {kind: [reference time per stage]})
    for the stages every kind was timed on, or None when F's passes held fewer than ``min_shapes``
    distinct microbatch shapes (nothing to tell a length's effect by)."""
    fs = samples.get(F) or {}
    shapes = {(t, q) for xs in fs.values() for t, q, _ in xs}
    if len(shapes) < min_shapes:
        return None
    stages = sorted(set.intersection(*(set(samples.get(k) or {}) for k in KINDS)) if all(samples.get(k) for k in KINDS)
                    else fs)
    att, fixed, ref = {}, {}, {}
    for k in KINDS:
        per = samples.get(k) or {}
        if not per:
            continue
        coef = [fit_coefficients(per[s], quadratic=k != W) if per.get(s) else (0.0, 0.0, 0.0) for s in stages]
        ref[k] = [attention_share(c, seq_length)[0] for c in coef]
        _, a, o = attention_share(tuple(sum(c[i] for c in coef) for i in range(3)), seq_length)
        if a:
            att[k] = min(a, 1.0)
        if o:
            fixed[k] = min(o, 1.0 - att.get(k, 0.0))
    return LengthModel(seq_length, att, fixed), ref
