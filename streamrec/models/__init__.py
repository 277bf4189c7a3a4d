"""streamrec.models: the HSTU model, its checkpoints, training and evaluation.

Entry points other packages call (see docs/contracts.md):
``hstu.HSTU.prefill/extend/rank/retrieve``, ``checkpoint.load_checkpoint``,
``vocabulary.ItemVocabulary``, ``training.train``, ``evaluation.evaluate``,
``datasets.read_movielens`` / ``datasets.synthetic_log``. Submodules are imported
explicitly so that importing this package does not pull in torch.
"""
