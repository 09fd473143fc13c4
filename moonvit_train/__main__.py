"""``python -m moonvit_train``: the trainer (:func:`moonvit_train.loop.main`); a full disk is one ``error:`` line
(:func:`moonvit.cli.exit_on`), naming the file being written."""

from moonvit.cli import ArgumentParser, exit_on

from .config import PROG
from .loop import main

with exit_on(ArgumentParser(prog=PROG)):
    main()
