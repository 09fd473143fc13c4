"""``python -m projector.export`` (and ``torchrun ... -m projector.export``)."""

from .cli import main

if __name__ == "__main__":
    main()
