"""The bounded variants' own claims ("bounds help"), decided with the vocabulary of :mod:`hardeq_studies.claims`.

The long-only portfolio and the non-negative flows are not experiments of the paper: their claims are this
repository's hypotheses ("deciding with the truncated law beats the untruncated model", "... beats clipping then
projecting"). They are decided exactly as the paper's claims are (paired tests over runs, Holm's adjustment over
the variant's family, the five verdicts of docs/claims.md), and rendered in their own section, so that they are
never counted among the paper's.
"""

from __future__ import annotations

from collections.abc import Sequence

from .claims import ALPHA, Claim, decide, format_p
from .results import markdown_table

__all__ = ["bounds_claims_section"]


def bounds_claims_section(title: str, claims: Sequence[Claim], intro: str = "", alpha: float = ALPHA) -> str:
    """``## TITLE``: the claims' table (claim, the evidence it is weighed against, here, raw p, Holm-adjusted p,
    verdict), the verdicts computed by :func:`hardeq_studies.claims.decide` over ``claims`` as one family."""
    decisions = decide(claims, alpha)
    m = sum(d.p_raw == d.p_raw for d in decisions)  # tested claims (the NaN of an untested one is not equal)
    rows = [[d.claim.claim, d.claim.paper, d.claim.here, format_p(d.p_raw), format_p(d.p_holm), d.verdict]
            for d in decisions]
    text = (f"## {title}\n\n" + (intro + "\n\n" if intro else "")
            + (f"These are hypotheses of this repository, not claims of the paper. Each tested one's two-sided paired "
               f"p is Holm-adjusted over the {m} tested claims of this section; the verdict reads the adjusted p at "
               f"level {alpha} and" if m else "No claim of this section has a test in this run; each verdict")
            + " is one of five (docs/claims.md): reproduced (the hypothesis holds), not reproduced at this budget, "
            "refuted, holds by construction, undecided.\n\n"
            + markdown_table(["claim (this repository)", "weighed against", "here", "p", "p (Holm)", "verdict"],
                             rows))
    return text
