"""The load tests' harness: what every benchmark in ``loadtest`` shares.

A benchmark (``loadtest/<name>.py``) imports these modules and no other benchmark; none of
them imports a benchmark.

- ``machine``: units, event loops, pre-faulted memory, CPU seconds of a process, the page
  cache, SIGTERM as Ctrl-C.
- ``cluster``: start and stop the cluster under test, its metrics and CPU.
- ``workers``: worker processes that run timed jobs together.
- ``checkpoint``: the checkpoint's bytes (``Layout``) and saving it with worker processes.
- ``baselines``, ``loopback``: what this machine does without storaged (loopback, codecs,
  raw file writes, DCP), measured in the same run.
- ``state_dict``: a training job's state dict (tensor shapes, arrays, digests) and the
  cluster sized for it.
- ``trace``: a ``Client`` that times its chunk requests; ``stopwatch``: timed windows with
  the CPU seconds of this process, of the nodes and of the machine.
- ``command``, ``report``, ``plots``, ``profile``: command line, results (JSON, markdown),
  plots (matplotlib optional), py-spy profiles.
- ``netns``: network namespaces joined by capped links (root), and a cluster whose nodes
  run in them (``fabric``).
- ``response_node``: a node variant that answers chunk GETs the old way (``web.Response``),
  the baseline of ``nodesend``.
"""
