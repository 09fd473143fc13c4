"""``eval`` is now ``moonvit_eval``: this name keeps old imports and ``python -m eval...`` working for
one more release, each of its modules the new package's own (:mod:`moonvit.renamed`)."""

from moonvit.renamed import alias_package

alias_package("eval", "moonvit_eval")
