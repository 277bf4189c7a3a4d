"""streamrec: a streaming generative-recommendation worker (HSTU + paged KV cache + Kafka).

The sub-packages form layers; imports only point down this list:

- ``schemas``  wire types and codecs
- ``models``   HSTU, checkpoints, training, AOTI export/load
- ``cache``    paged KV block pool, host tier, history store, embedding cache
- ``pipeline`` micro-batcher and inference engine
- ``worker``   Kafka, offsets, metrics, CLI (the composition root is ``worker/app.py``)
"""

__version__ = "0.1.0"
