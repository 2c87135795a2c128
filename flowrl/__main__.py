"""``python -m flowrl``: the ``flowrl`` command (:mod:`flowrl.commands.main`)."""

import sys

from flowrl.commands.main import main

sys.exit(main())
