"""``python -m gateway`` is the ``egress-gateway`` command."""

import sys

from gateway.cli import main

sys.exit(main())
