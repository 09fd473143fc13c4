"""``projector`` is now ``moonvit_projector``: this name keeps old imports and ``python -m projector...`` working for
one more release, each of its modules the new package's own (:mod:`moonvit.renamed`)."""

from moonvit.renamed import alias_package

alias_package("projector", "moonvit_projector")
