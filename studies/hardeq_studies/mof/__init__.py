"""Study ``mof``: charge-neutral partial charges of metal-organic frameworks with a message-passing network
(the paper's Table 5; docs/mof.md). Needs ``pip install "hardeq-studies[graphs]"``."""
