"""``python -m mmviews.cli ...`` (and ``accelerate launch -m mmviews.cli ...``)."""

import sys

from mmviews.cli import main

if __name__ == "__main__":
    sys.exit(main())
