"""``python -m agent.node``: the node agent."""

import sys

from agent.node import main

sys.exit(main())
