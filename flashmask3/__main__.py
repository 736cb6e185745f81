"""``python -m flashmask3 ...``: the ``flashmask3`` command (demo, train, data, env) where the
console script is not on the PATH (a source checkout on ``PYTHONPATH``)."""

import sys

from .train.cli import main

if __name__ == "__main__":
    sys.exit(main())
