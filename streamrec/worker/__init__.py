"""streamrec.worker: the worker runtime: loops, Kafka consumer and producer, offsets,
hand-over, metrics and health. The CLI and the dev broker live in ``streamrec.tools``."""
