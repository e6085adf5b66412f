"""Imported by Python at the start of every rank the node agent launches (this
directory comes first on the ranks' ``PYTHONPATH``): fits a torchrun started
below a wrapper script to the job (:mod:`agent.node.torchrunshim`; the process is
replaced), arms Resurgo's automatic progress (:mod:`agent.train.autohooks`)
and the note of an uncaught exception (:mod:`agent.wire.raised`), then runs
the ``sitecustomize`` that this one shadows, if there is one, so that a
distribution's or the user's still runs. Never raises: a rank must start
whatever happens here.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _arm() -> None:
    try:
        from agent.node.torchrunshim import refit_if_torchrun

        refit_if_torchrun()
    except SystemExit as refused:
        # torchrun arguments that cannot be fitted: said in one line, and this torchrun
        # ends (raised from here, Python would call it a fatal error of its start).
        print(refused, file=sys.stderr, flush=True)
        os._exit(2)
    except Exception:  # never stop a rank from starting
        pass
    try:
        from agent.bootstrap import arm_rank

        arm_rank()
    except Exception:  # never stop a rank from starting
        pass


def _run_the_shadowed_one() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


_arm()
_run_the_shadowed_one()
