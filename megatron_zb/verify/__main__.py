import sys

from .command import main_verify

sys.exit(main_verify())
