"""``python -m agent.driver``: the in-job driver, the batch script's main program."""

import sys

from agent.driver.loop import main

sys.exit(main())
