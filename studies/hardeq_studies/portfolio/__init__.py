"""The ``portfolio`` study: StemGNN allocations whose weights sum to one (paper Table 7; docs/portfolio.md)."""
