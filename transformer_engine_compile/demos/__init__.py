"""Demos, run with ``python -m``: :mod:`.parallel` (tensor + sequence
parallel te.Linear under torch.compile, on ``torchrun``) and :mod:`.tour`
(each format's error and bytes per element).  The README's main job is
``python -m transformer_engine_compile`` (``__main__.py``)."""
