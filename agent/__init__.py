"""Resurgo's compute-node side: the node agent, the in-job driver and the
in-rank library that training scripts import (``agent.train``)."""

# The release, as pyproject.toml's [project] version says (a test keeps them equal);
# every entry point's --version shows it.
__version__ = "0.1.0"
