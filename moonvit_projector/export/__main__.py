"""``python -m moonvit_projector.export`` (and ``torchrun ... -m moonvit_projector.export``)."""

from .cli import main

if __name__ == "__main__":
    main()
