"""streamrec.offline: what runs before serving: data sets, training, evaluation.

Nothing in the worker runtime imports this package; the tools (``streamrec train``,
``eval``, the demo) do.
"""
