"""streamrec.tools: the command line (``streamrec ...``), the demo, the dev broker, produce.

The tools compose the runtime (``streamrec.worker``) and the offline package; nothing in
the runtime imports them.
"""
