"""``python -m numkv`` and the ``numkv`` script: the command line lives in ``numkv._cli``."""

import sys

from numkv._cli import build_parser, main  # noqa: F401 - the script's entry point, and tests'

if __name__ == "__main__":
    sys.exit(main())
