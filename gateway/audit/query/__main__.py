"""``python -m gateway.audit.query``: the ``egress-gateway audit`` commands on their own."""

import sys

from gateway.audit.query.cli import main

sys.exit(main())
