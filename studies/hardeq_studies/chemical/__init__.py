"""Study ``chemical``: neural surrogates of chemical processes that must respect mass balances.

Modules: :mod:`.data` (settings, data sets), :mod:`.task` (methods, losses, metrics), :mod:`.models` (the
batched network), :mod:`.run` (training and evaluation), :mod:`.report` (tables, paired tests, figures),
:mod:`.study` (the CLI contract). Protocol and discussion: docs/chemical.md.
"""
