"""``train`` is now ``moonvit_train``: this name keeps old imports and ``python -m train...`` working for
one more release, each of its modules the new package's own (:mod:`moonvit.renamed`)."""

from moonvit.renamed import alias_package

alias_package("train", "moonvit_train")
