"""streamrec.models: the HSTU model as it is served: weights, kernels, checkpoints, AOTI.

Entry points other packages call (see docs/contracts.md):
``hstu.HSTU.prefill/extend/rank/retrieve``, ``checkpoint.load_checkpoint``,
``vocabulary.ItemVocabulary``, ``aoti_runtime.AOTIModel``. Training and evaluation live in
``streamrec.offline``. Submodules are imported explicitly so that importing this package
does not pull in torch.
"""
