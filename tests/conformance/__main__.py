"""``python -m zero_core.conformance``: see the package docstring."""
import sys

from .cli import main

sys.exit(main())
