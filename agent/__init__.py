"""Resurgo's compute-node side: the node agent, the in-job driver and the
in-rank library that training scripts import (``agent.train``)."""
