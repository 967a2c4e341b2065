"""Bridges to other libraries, each imported on its own and only when asked for (``hardeq.contrib.pyro``).

Nothing here is imported by ``import hardeq``: a bridge needs the library it bridges to (an extra, e.g.
``pip install "hardeq[pyro]"``), and says so when it is missing.
"""
