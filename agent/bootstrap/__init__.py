"""The directory the node agent puts first on its ranks' ``PYTHONPATH``: its
``sitecustomize`` arms automatic progress (:mod:`agent.train.autohooks`) and the
note of an uncaught exception (:mod:`agent.wire.raised`) in every rank, through
:func:`arm_rank`, which a rank forked from the warm pool calls itself
(:mod:`agent.node.warmchild`)."""


def arm_rank() -> None:
    """Arm Resurgo's hooks in this rank (its environment set). Never raises: a rank must
    start whatever happens here."""
    try:
        from agent.train.autohooks import install

        install()
    except Exception:  # never stop a rank from starting
        pass
    try:
        from agent.wire import raised

        raised.install()
    except Exception:  # never stop a rank from starting
        pass
