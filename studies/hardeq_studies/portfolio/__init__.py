"""The ``portfolio`` study: StemGNN allocations whose weights sum to one (paper Table 9; docs/portfolio.md)."""
