"""The directory the node agent puts first on its ranks' ``PYTHONPATH``: its
``sitecustomize`` arms automatic progress (:mod:`agent.train.autohooks`)."""
