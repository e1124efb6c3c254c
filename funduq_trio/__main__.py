"""`python -m funduq_trio serve | provider | call`."""

import sys

from .cli import main

sys.exit(main())
