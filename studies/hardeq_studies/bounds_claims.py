"""The bounded variants' own claims ("bounds help"), decided with the vocabulary of :mod:`hardeq_studies.claims`.

The long-only portfolio and the non-negative flows are not experiments of the paper: their claims are this
repository's hypotheses ("deciding with the truncated law beats the untruncated model", "... beats clipping then
projecting"). They are decided exactly as the paper's claims are (paired tests over runs, the six verdicts of
docs/claims.md) and in the *same* Holm family as the study's claims of the paper (one family per study), but
rendered in their own section, so that they are never counted among the paper's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .claims import ALPHA, VOCABULARY, Claim, decide, family_sentence, family_size, format_p, holm_floor
from .results import markdown_table

__all__ = ["bounds_claims_section", "as_hypotheses"]


def as_hypotheses(claims: Sequence[Claim]) -> list[Claim]:
    """``claims`` marked as this repository's hypotheses (:attr:`Claim.hypothesis`)."""
    return [replace(c, hypothesis=True) for c in claims]


def bounds_claims_section(title: str, claims: Sequence[Claim], intro: str = "", alpha: float = ALPHA,
                          family: Sequence[Claim] = ()) -> str:
    """``## TITLE``: the claims' table (claim, the evidence it is weighed against, here, raw p, Holm-adjusted p,
    verdict), the verdicts computed by :func:`hardeq_studies.claims.decide` with Holm's adjustment over
    ``claims`` and ``family`` (the study's claims of the paper) as one family."""
    mine = as_hypotheses(claims)
    decisions = decide(mine, alpha, family)
    m = family_size(list(mine) + list(family))
    rows = [[d.claim.claim, d.claim.paper, d.claim.here, format_p(d.p_raw), format_p(d.p_holm), d.verdict]
            for d in decisions]
    text = (f"## {title}\n\n" + (intro + "\n\n" if intro else "")
            + "These are hypotheses of this repository, not claims of the paper. "
            + family_sentence(m, family_size(mine), alpha, "this section's rows" if family else "",
                              holm_floor(list(mine) + list(family)))
            + f" is one of six (docs/claims.md; for a hypothesis, reproduced means it holds): {VOCABULARY}.\n\n"
            + markdown_table(["claim (this repository)", "weighed against", "here", "p", "p (Holm)", "verdict"],
                             rows))
    return text
