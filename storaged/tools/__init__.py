"""Tools around the service, not part of it: the local-cluster launcher (``local_cluster.py``,
``cluster_file.py``: what ``storaged up`` and the tests run), the demo, and the sizing
advice with its scale model (``advise.py``, ``model.py``)."""
