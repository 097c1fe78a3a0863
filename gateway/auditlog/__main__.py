"""``python -m gateway.auditlog``: the ``egress-gateway audit`` commands on their own."""

import sys

from gateway.auditlog.cli import main

sys.exit(main())
